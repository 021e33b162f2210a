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
from services.common.bus import (
    KV_RESYNC_SUBJECT,
    SHARED_KV_SUBJECT,
    EventBus,
    kv_subject,
    load_subject,
    register_subject,
)
from services.common.entry import stop_on_signals
from services.common.grpc_server import GrpcServer
from services.common.kv_index import GPU, HOST, SHARED, SHARED_HOLDER, KvIndex
from services.common.telemetry import setup_tracing, shutdown_tracing
from services.scheduler.config import SchedulerConfig
from services.scheduler.placement import PlacementPolicy
from services.scheduler.registry import Registry
from services.scheduler.servicer import SchedulerServicer

logger = logging.getLogger("services.scheduler")
ROLES = ("colocated", "prefill", "decode")


class EventHandlers:
    """What the scheduler does with the NATS events: load reports (heartbeats),
    workers' KV events and the shared tier's (a gap asks that worker to resync; a
    report from a worker not registered asks it to register again)."""

    ASK_INTERVAL = 1.0  # seconds between two requests to register again, per worker

    def __init__(self, registry: Registry, index: KvIndex, bus: EventBus):
        self.registry, self.index, self.bus = registry, index, bus
        self._asked: dict[str, float] = {}

    async def on_load(self, report: common_pb2.LoadReport, headers) -> None:
        known = self.registry.on_load(
            report.worker_id,
            report.num_requests_running,
            report.num_requests_waiting,
            report.kv_cache_usage,
        )
        now = time.monotonic()
        if not known and now - self._asked.get(report.worker_id, -1e9) >= self.ASK_INTERVAL:
            # A draining worker ignores this; any other rejoins placement.
            self._asked[report.worker_id] = now
            await self.bus.publish(register_subject(report.worker_id), empty_pb2.Empty())

    async def on_kv(self, events: common_pb2.KvEvents, headers) -> None:
        if events.worker_id not in self.registry.workers:
            return
        changes = {GPU: (events.stored, events.removed),
                   HOST: (events.host_stored, events.host_removed)}  # fmt: skip
        await self._apply(events.worker_id, events.event_id, changes, events.reset)

    async def on_shared(self, events: common_pb2.SharedKvEvents, headers) -> None:
        # on a gap the KV store answers with a reset batch of the shared tier
        changes = {SHARED: (events.stored, events.removed)}
        await self._apply(SHARED_HOLDER, events.event_id, changes, events.reset)

    async def _apply(self, holder: str, event_id: int, changes: dict, reset: bool) -> None:
        """Applies one holder's numbered batch; a gap is counted and asks it to resync."""
        gaps = self.index.gaps
        in_order = self.index.apply(holder, event_id, changes, reset)
        if self.index.gaps > gaps:
            metrics.KV_INDEX_GAPS.labels(holder=holder).inc()
        if not in_order:
            await self.bus.publish(
                KV_RESYNC_SUBJECT, common_pb2.KvResync(worker_id=holder, reason="gap")
            )

    async def listen(self) -> None:
        await self.bus.subscribe(load_subject(), common_pb2.LoadReport, self.on_load,
                                 lambda m: load_subject(m.worker_id))  # fmt: skip
        await self.bus.subscribe(kv_subject(), common_pb2.KvEvents, self.on_kv,
                                 lambda m: kv_subject(m.worker_id))  # fmt: skip
        await self.bus.subscribe(SHARED_KV_SUBJECT, common_pb2.SharedKvEvents, self.on_shared)


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
    registry = Registry(config.heartbeat_timeout)
    index = KvIndex()
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
            index.forget(gone.worker_id)
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
