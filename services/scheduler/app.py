"""The scheduler's process: the gRPC server (registration, placement), the
NATS subscriptions that keep the registry and the KV index current, and the
loop that drops workers whose heartbeats stopped. It keeps no state on disk: a
restarted scheduler asks every worker it hears from to register again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from google.protobuf import empty_pb2

from proto.yinian.v1 import common_pb2, scheduler_pb2_grpc
from services.common import metrics
from services.common.bus import EventBus, register_subject
from services.common.entry import stop_on_signals
from services.common.grpc_server import GrpcServer
from services.common.kv_index import KvIndex
from services.common.placement import PlacementPolicy
from services.common.placement_feed import PlacementFeed
from services.common.registry import Registry
from services.common.telemetry import setup_tracing, shutdown_tracing
from services.scheduler.config import SchedulerConfig
from services.scheduler.servicer import SchedulerServicer

logger = logging.getLogger("services.scheduler")
ROLES = ("colocated", "prefill", "decode")


class EventHandlers(PlacementFeed):
    """The scheduler's NATS listener (PlacementFeed), which also asks a worker it hears
    from but does not know to register again (the scheduler restarted)."""

    ASK_INTERVAL = 1.0  # seconds between two requests to register again, per worker

    def __init__(self, registry: Registry, index: KvIndex, bus: EventBus):
        super().__init__(registry, index, bus, metrics.KV_INDEX_GAPS)
        self._asked: dict[str, float] = {}

    async def on_load(self, report: common_pb2.LoadReport, headers) -> bool:
        known = await super().on_load(report, headers)
        now = time.monotonic()
        if not known and now - self._asked.get(report.worker_id, -1e9) >= self.ASK_INTERVAL:
            # A draining worker ignores this; any other rejoins placement.
            self._asked[report.worker_id] = now
            await self.bus.publish(register_subject(report.worker_id), empty_pb2.Empty())
        return known


def export_index(index: KvIndex, shown: set) -> set:
    """The index's sizes as `yinian:kv_index_blocks`; a holder it forgot leaves the
    metric. Returns what is shown now."""
    sizes = index.sizes()
    for (holder, tier), count in sizes.items():
        metrics.KV_INDEX_BLOCKS.labels(holder=holder, tier=tier).set(count)
    for holder, tier in shown - sizes.keys():
        metrics.KV_INDEX_BLOCKS.remove(holder, tier)
    return set(sizes)


def expert_plane(config: SchedulerConfig):
    """The expert balancer's part of the process, or its refusals when it is off."""
    if not config.expert_balancer:
        from services.scheduler.expert_off import NoExpertPlane

        return NoExpertPlane()
    from services.scheduler.expert_plane import ExpertPlane  # loads torch

    return ExpertPlane(config, config.tls_files())


async def run(config: SchedulerConfig) -> None:
    setup_tracing("yinian-scheduler")
    index = KvIndex()
    registry = Registry(config.heartbeat_timeout, forget=index.forget)
    servicer = SchedulerServicer(
        registry,
        index,
        PlacementPolicy(
            max_waiting=config.max_waiting,
            host_hit_weight=config.host_hit_weight,
            shared_hit_weight=config.shared_hit_weight,
            disagg_min_tokens=config.disagg_min_tokens,
            request_tokens=config.placement_request_tokens,
            memory_tokens=config.placement_memory_tokens,
        ),
        heartbeat_interval=config.heartbeat_timeout / 4,
    )
    server = GrpcServer(config.host, config.port, config.tls_files())
    server.add(
        scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer, ["yinian.v1.Scheduler"]
    )
    experts = expert_plane(config)
    experts.add_to(server)
    await server.start()
    metrics_port = metrics.serve_metrics(config.metrics_port, config.host, metrics.SCHEDULER)
    bus = EventBus(config.nats_url, "scheduler")
    await bus.connect()
    await EventHandlers(registry, index, bus).listen()
    await experts.subscribe(bus)
    await server.serving(True)
    print(f"READY scheduler {config.host}:{server.port} metrics {config.host}:{metrics_port}",
          flush=True)  # fmt: skip

    stop = stop_on_signals()
    shown: set = set()
    while not stop.is_set():
        if not bus.connected:
            # No heartbeat can arrive while NATS is away: that is no sign of a
            # dead worker, so none is dropped for it (the gateway re-places a
            # request whose worker did die).
            registry.touch_all()
        for gone in registry.expire():
            logger.warning("dropped %s: %s", gone.worker_id, registry.why_dropped(gone))
        for role in ROLES:
            metrics.READY_WORKERS.labels(role=role).set(len(registry.ready(role)))
        shown = export_index(index, shown)
        await experts.tick(bus.connected)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=0.25)
    await server.serving(False)
    await server.stop(grace=1.0)
    await experts.close()
    await bus.close()
    shutdown_tracing()
