"""Serves the gateway: the FastAPI app on uvicorn and the gRPC API, both ready
only when the scheduler has a ready worker behind it; both on TLS when the
gateway has a certificate (it then shows it to the scheduler and workers too).
SIGHUP reads the API keys and tenant limits again."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import grpc
import uvicorn

from proto.yinian.v1 import inference_pb2_grpc
from services.common import metrics
from services.common.bus import EventBus
from services.common.grpc_server import GrpcServer
from services.common.processes import listen_socket
from services.common.telemetry import setup_tracing, shutdown_tracing
from services.gateway.admission import Admission
from services.gateway.auth import Authenticator, check_listen_address, load_keys
from services.gateway.clients import SchedulerClient, WorkerPool, serving_workers
from services.gateway.config import GatewayConfig
from services.gateway.frontend import Frontend
from services.gateway.gateway_core import GatewayCore
from services.gateway.http_protocol import connection_cap, protocol
from services.gateway.local_placement import LocalPlacement
from services.gateway.openai_api import create_app
from services.gateway.servicer import InferenceServicer

logger = logging.getLogger(__name__)


class HealthProbe:
    """Ready when the scheduler answers and has a ready worker, and the gateway's own
    placer (when it places requests) is not warming up; with the scheduler away, when
    that placer places and knows a ready worker. Cached briefly. The list it reads goes
    to that placer too: once the gateway says it is ready, it knows every worker the
    scheduler then knew."""

    def __init__(self, scheduler: SchedulerClient, ttl: float = 0.5, placer=None):
        self.scheduler, self.placer = scheduler, placer
        self.ttl = ttl
        self._at = 0.0
        self._ready = False

    async def __call__(self) -> bool:
        now = time.monotonic()
        if now - self._at > self.ttl:
            self._ready = await self._check()
            self._at = now
        return self._ready

    async def _check(self) -> bool:
        try:
            if self.placer is None:
                listing = await self.scheduler.list_workers()
            else:
                listing = await self.placer.refresh()
        except grpc.RpcError:  # the scheduler away: ready while this gateway places
            return self.placer is not None and self.placer.serving() > 0
        if self.placer is not None and self.placer.warming:
            return False
        return serving_workers(listing) > 0


async def run(config: GatewayConfig) -> None:
    setup_tracing("yinian-gateway")
    auth = Authenticator(load_keys(config.api_keys), config.api_keys)
    check_listen_address(config.host, auth, config.allow_unauthenticated)
    tls = config.tls_files()
    scheduler = SchedulerClient(config.scheduler, tls=tls)
    placer = scheduler
    if config.places_itself:
        placer = LocalPlacement(scheduler, EventBus(config.nats_url, "gateway"))
        metrics.GATEWAY_KV_INDEX_BLOCKS.index = placer.index  # its size, as the scheduler's
        await placer.start()
    workers = WorkerPool(tls, links=config.worker_links)
    core = GatewayCore(
        config.served_model_name,
        config.model,
        None,
        config.max_model_len,
        config.public_prefixes,
        config.tool_call_parser,
    )
    core.frontend = Frontend(
        core.tokenizer,
        placer,
        workers,
        config.block_size,
        config.request_timeout,
        config.idle_timeout,
        max_migrations=config.max_migrations,
    )
    # a concurrency slot in Redis outlives the longest request (a dead gateway's expire)
    # a slot's lease outlives the longest request: a worker call may be retried on
    # another worker once per migration, each call with its own deadline
    lease = config.request_timeout * (config.max_migrations + 1) + 30
    core.admission = Admission(config.tenant_limits, config.redis_url, lease)
    health = HealthProbe(scheduler, placer=placer if placer is not scheduler else None)
    app = create_app(core, auth, health, config.max_body_bytes, config.body_timeout)

    def reload() -> None:
        auth.reload()
        core.admission.reload()

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)
    grpc_server = GrpcServer(
        config.host,
        config.grpc_port,
        tls,
        require_client_cert=False,
        what="gRPC (Inference)",
        max_message_bytes=config.max_body_bytes,
        internal=False,  # the public API: API keys, not the mesh's token
    )
    rest_socket = listen_socket(config.host, config.port, "REST")
    grpc_server.add(
        inference_pb2_grpc.add_InferenceServicer_to_server,
        InferenceServicer(core, auth),
        ["yinian.v1.Inference"],
    )
    await grpc_server.start()
    await grpc_server.serving(True)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="warning",
        loop="none",
        lifespan="off",
        timeout_graceful_shutdown=config.drain_timeout,
        timeout_keep_alive=config.keep_alive_timeout,
        http=protocol(config.header_timeout, connection_cap(config.max_connections)),
        **(tls.uvicorn_options() if tls else {}),
    )
    server = uvicorn.Server(uv_config)
    server.install_signal_handlers = lambda: None  # we handle signals below
    serve_task = asyncio.create_task(server.serve(sockets=[rest_socket]))
    while not server.started:
        if serve_task.done():
            serve_task.result()
        await asyncio.sleep(0.02)
    scheme = "https" if tls else "http"
    rest_port = rest_socket.getsockname()[1]  # the port bound, also for --port 0
    print(
        f"READY gateway {scheme}://{config.host}:{rest_port} grpc {config.host}:{grpc_server.port}",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await asyncio.wait(
        {serve_task, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED
    )
    # Draining: no new connection is taken; what is in flight has drain_timeout to end.
    server.should_exit = True
    await grpc_server.serving(False)
    await asyncio.gather(
        grpc_server.stop(grace=config.drain_timeout),
        asyncio.wait({serve_task}, timeout=config.drain_timeout + 3),
    )
    await workers.close()
    if placer is not scheduler:
        await placer.close()
    await scheduler.close()
    await core.admission.close()
    shutdown_tracing()
