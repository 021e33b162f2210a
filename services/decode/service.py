"""A worker's life: load the engine, serve gRPC, register with the scheduler,
report load and KV events over NATS until told to stop."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc

from engine import AsyncLLM
from proto.yinian.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2_grpc
from services.common import metrics
from services.common.bus import EventBus, kv_subject, load_subject
from services.common.grpc_server import GrpcServer
from services.common.kv_transport.registry import make_sender
from services.common.telemetry import setup_tracing, shutdown_tracing
from services.decode.config import WorkerConfig
from services.decode.prefill_client import PrefillClient
from services.decode.remote_prefill import RemotePrefill
from services.decode.server import WorkerServicer
from services.decode.worker_core import WorkerCore
from services.prefill.prefill_core import PrefillCore


class SenderSet:
    """Prefill role: one sender per transport, made on first use."""

    def __init__(self, engine: AsyncLLM, loop: asyncio.AbstractEventLoop):
        self.device = engine.engine.runner.device
        self.loop = loop
        self._senders: dict = {}

    def get(self, name: str):
        if name not in self._senders:
            self._senders[name] = make_sender(name, self.device, self.loop)
        return self._senders[name]


logger = logging.getLogger(__name__)


def worker_info(
    config: WorkerConfig, engine: AsyncLLM, address: str, metrics_address: str
) -> scheduler_pb2.WorkerInfo:
    runner = engine.engine.runner
    transports = config.kv_transports or (
        ["cuda_ipc", "tcp"] if runner.device.type == "cuda" else ["tcp"]
    )
    return scheduler_pb2.WorkerInfo(
        worker_id=config.worker_id,
        address=address,
        role=config.role,
        model=config.model,
        block_size=engine.engine.config.block_size,
        max_num_seqs=engine.engine.config.max_num_seqs,
        kv_blocks_total=runner.num_blocks,
        metrics_address=metrics_address,
        transports=transports,
        host=config.advertise_host or config.host,
        device=str(runner.device),
    )


def endpoint(info: scheduler_pb2.WorkerInfo) -> dict:
    return {
        "host": info.host,
        "device": info.device,
        "transports": list(info.transports),
        "worker_id": info.worker_id,
    }


async def register(
    config: WorkerConfig, info: scheduler_pb2.WorkerInfo, timeout: float = 60.0
) -> None:
    """Registers with the scheduler, retrying until it answers."""
    deadline = asyncio.get_running_loop().time() + timeout
    async with grpc.aio.insecure_channel(config.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        while True:
            try:
                await stub.Register(info, timeout=2.0)
                return
            except grpc.RpcError as exc:
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError(
                        f"scheduler {config.scheduler} unreachable: {exc.details()}"
                    ) from exc
                await asyncio.sleep(0.3)


async def report_loop(config: WorkerConfig, core: WorkerCore, bus: EventBus) -> None:
    labels = {"worker": config.worker_id}
    while True:
        load = core.load()
        metrics.NUM_REQUESTS_RUNNING.labels(**labels).set(load["num_requests_running"])
        metrics.NUM_REQUESTS_WAITING.labels(**labels).set(load["num_requests_waiting"])
        metrics.KV_CACHE_USAGE.labels(**labels).set(load["kv_cache_usage"])
        metrics.PREFIX_CACHE_HIT.labels(**labels).set(load["prefix_cache_hit_rate"])
        metrics.NUM_PREEMPTIONS.labels(**labels).set(load["num_preemptions"])
        fields = common_pb2.LoadReport.DESCRIPTOR.fields_by_name
        await bus.publish(
            load_subject(config.worker_id),
            common_pb2.LoadReport(**{k: v for k, v in load.items() if k in fields}),
        )
        await asyncio.sleep(config.load_interval)


async def kv_event_loop(
    config: WorkerConfig, core: WorkerCore, bus: EventBus, interval: float = 0.02
) -> None:
    """KV events go out as soon as they exist, so placement learns of new
    prefixes within a step or two."""
    while True:
        batch = core.kv_events()
        if batch is not None:
            await bus.publish(
                kv_subject(config.worker_id),
                common_pb2.KvEvents(
                    worker_id=config.worker_id,
                    event_id=batch.event_id,
                    stored=batch.stored,
                    removed=batch.removed,
                    reset=batch.reset,
                ),
            )
        await asyncio.sleep(interval)


async def run_worker(config: WorkerConfig) -> None:
    setup_tracing(f"yinian-{config.role}")
    engine = AsyncLLM.from_model(config.model, **config.engine_options)
    server = GrpcServer(config.host, config.port)
    host = config.advertise_host or config.host
    address = f"{host}:{server.port}"
    metrics_port = metrics.serve_metrics(config.metrics_port, config.host)
    info = worker_info(config, engine, address, f"{host}:{metrics_port}")
    remote = prefill_core = None
    if config.role == "decode":
        remote = RemotePrefill(
            engine,
            PrefillClient(),
            endpoint(info),
            config.worker_id,
            config.kv_lease_seconds,
            config.prefill_timeout,
        )
    elif config.role == "prefill":
        prefill_core = PrefillCore(engine, SenderSet(engine, asyncio.get_running_loop()).get)
    core = WorkerCore(engine, config.worker_id, remote)
    server.add(
        worker_pb2_grpc.add_WorkerServicer_to_server,
        WorkerServicer(core, info, prefill_core),
        ["yinian.v1.Worker"],
    )
    await server.start()
    bus = EventBus(config.nats_url, config.worker_id)
    await bus.connect()
    await register(config, info)
    reporters = [
        asyncio.create_task(report_loop(config, core, bus)),
        asyncio.create_task(kv_event_loop(config, core, bus)),
    ]
    await server.serving(True)
    logger.info("worker %s (%s) serving on %s", config.worker_id, config.role, address)
    print(f"READY worker {config.worker_id} {address}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("worker %s stopping", config.worker_id)
    await server.serving(False)
    try:
        async with grpc.aio.insecure_channel(config.scheduler) as channel:
            await scheduler_pb2_grpc.SchedulerStub(channel).Deregister(
                scheduler_pb2.DeregisterRequest(worker_id=config.worker_id), timeout=1.0
            )
    except grpc.RpcError:
        pass
    for task in reporters:
        task.cancel()
    if remote is not None:
        await remote.close()
    await server.stop(grace=1.0)
    await bus.close()
    engine.shutdown()
    shutdown_tracing()
