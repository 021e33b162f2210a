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
from services.common.telemetry import setup_tracing, shutdown_tracing
from services.decode.config import WorkerConfig
from services.decode.server import WorkerServicer
from services.decode.worker_core import WorkerCore

logger = logging.getLogger(__name__)


async def register(
    config: WorkerConfig,
    core: WorkerCore,
    address: str,
    metrics_address: str,
    timeout: float = 60.0,
) -> None:
    """Registers with the scheduler, retrying until it answers."""
    stats = core.load()
    info = scheduler_pb2.WorkerInfo(
        worker_id=config.worker_id,
        address=address,
        role=config.role,
        model=config.model,
        block_size=core.block_size,
        max_num_seqs=core.engine.engine.config.max_num_seqs,
        kv_blocks_total=stats["kv_blocks_total"],
        metrics_address=metrics_address,
        transports=["tcp"],
        host=config.advertise_host or config.host,
    )
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
    core = WorkerCore(engine, config.worker_id)
    server = GrpcServer(config.host, config.port)
    server.add(
        worker_pb2_grpc.add_WorkerServicer_to_server, WorkerServicer(core), ["yinian.v1.Worker"]
    )
    await server.start()
    address = f"{config.advertise_host or config.host}:{server.port}"
    metrics_port = metrics.serve_metrics(config.metrics_port, config.host)
    bus = EventBus(config.nats_url, config.worker_id)
    await bus.connect()
    await register(config, core, address, f"{config.advertise_host or config.host}:{metrics_port}")
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
    await server.stop(grace=1.0)
    await bus.close()
    engine.shutdown()
    shutdown_tracing()
