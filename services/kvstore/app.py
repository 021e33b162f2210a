"""The KV store's process: the gRPC server (Lookup, Put, Get, Stats), the NATS
subscriptions that keep the global index current (workers' KvEvents and load
reports, KvResync requests for the shared tier), and the loop that publishes
the shared tier's SharedKvEvents, forgets silent workers and rebuilds after
Redis comes back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from proto.yinian.v1 import common_pb2, kvstore_pb2_grpc
from services.common import metrics
from services.common.bus import (
    KV_RESYNC_SUBJECT,
    SHARED_KV_SUBJECT,
    EventBus,
    kv_subject,
    load_subject,
)
from services.common.entry import stop_on_signals
from services.common.grpc_server import GrpcServer
from services.common.kv_index import SHARED_HOLDER
from services.common.telemetry import setup_tracing, shutdown_tracing
from services.kvstore.config import KvStoreConfig
from services.kvstore.global_index import GlobalIndex
from services.kvstore.ledger import Ledger
from services.kvstore.redis_guard import TierUnavailable
from services.kvstore.servicer import KvStoreServicer
from services.kvstore.shared_events import SharedEventLog
from services.kvstore.shared_tier import SharedTier
from services.kvstore.store import KvStore
from services.kvstore.tiers import build_tiers

logger = logging.getLogger("services.kvstore")
PUBLISH_INTERVAL = 0.05  # seconds between SharedKvEvents batches
HOUSEKEEPING_INTERVAL = 1.0
GAUGE_INTERVAL = 5.0
RECONCILE_INTERVAL = 30.0


class EventHandlers:
    """What the KV store does with the NATS events it reads."""

    def __init__(self, index: GlobalIndex, events: SharedEventLog, bus: EventBus):
        self.index, self.events, self.bus = index, events, bus

    async def on_kv(self, batch: common_pb2.KvEvents, headers) -> None:
        gap = self.index.on_events(
            batch.worker_id,
            batch.event_id,
            (list(batch.stored), list(batch.removed)),
            (list(batch.host_stored), list(batch.host_removed)),
            batch.reset,
        )
        if gap:
            logger.info("asking %s for a resync (event %d)", batch.worker_id, batch.event_id)
            await self.bus.publish(
                KV_RESYNC_SUBJECT, common_pb2.KvResync(worker_id=batch.worker_id, reason="gap")
            )

    def on_load(self, report: common_pb2.LoadReport, headers) -> None:
        self.index.on_load(report.worker_id)

    def on_resync(self, request: common_pb2.KvResync, headers) -> None:
        if request.worker_id in ("", SHARED_HOLDER):
            self.events.reset_wanted = True

    async def listen(self) -> None:
        """Subscribes to workers' KV events and load reports, then asks every worker
        for a reset batch (so the index survives a restart) before subscribing to
        resync requests (so the store never hears its own)."""
        await self.bus.subscribe(kv_subject(), common_pb2.KvEvents, self.on_kv,
                                 lambda m: kv_subject(m.worker_id))  # fmt: skip
        await self.bus.subscribe(load_subject(), common_pb2.LoadReport, self.on_load,
                                 lambda m: load_subject(m.worker_id))  # fmt: skip
        await self.bus.publish(KV_RESYNC_SUBJECT, common_pb2.KvResync(reason="kv store started"))
        await self.bus.subscribe(KV_RESYNC_SUBJECT, common_pb2.KvResync, self.on_resync)


async def take_snapshot(store: KvStore, events: SharedEventLog) -> None:
    """Queues a reset batch of everything in the memory tier and Redis (Redis's
    part empty when it is down or off; Redis coming back queues another)."""
    events.begin_snapshot()
    hashes = store.memory.snapshot() if store.memory is not None else []
    try:
        hashes += await store.tier.snapshot() if store.tier is not None else []
    except TierUnavailable:
        pass
    events.snapshot(hashes)


async def publish_shared(bus: EventBus, events: SharedEventLog) -> None:
    for batch in events.batches():
        await bus.publish(
            SHARED_KV_SUBJECT,
            common_pb2.SharedKvEvents(
                event_id=batch.event_id,
                stored=batch.stored,
                removed=batch.removed,
                reset=batch.reset,
            ),
        )


class Housekeeping:
    """Once a second: forget silent workers, follow Redis going down and
    coming back, and queue the snapshots that follow."""

    def __init__(self, store: KvStore, tier: SharedTier | None, events: SharedEventLog):
        self.store, self.tier, self.events = store, tier, events
        self.announced_down = False

    async def __call__(self) -> None:
        for worker_id in self.store.index.expire():
            logger.warning("forgot %s: no load report or KV event for a while", worker_id)
        tier = self.tier
        if tier is not None:
            if not tier.guard.up and not await tier.guard.ping() and not self.announced_down:
                # Nothing in Redis can be read now: subscribers stop counting on it.
                self.announced_down = True
                self.events.reset_wanted = True
            if tier.guard.recovered():
                # Redis may have restarted empty: recount, resend a snapshot.
                self.announced_down = False
                with contextlib.suppress(TierUnavailable):
                    await tier.reconcile()
                self.events.reset_wanted = True
        if self.events.reset_wanted:
            await take_snapshot(self.store, self.events)


async def run(config: KvStoreConfig) -> None:
    setup_tracing("yinian-kvstore")
    ledger, events = Ledger(), SharedEventLog()
    index = GlobalIndex(config.worker_timeout)
    tier, memory, spiller = build_tiers(config, ledger, events)
    store = KvStore(tier, index, ledger, config.max_block_bytes, memory)
    spilling = asyncio.create_task(spiller.drain()) if spiller is not None else None
    server = GrpcServer(config.host, config.port, config.tls_files())
    servicer = KvStoreServicer(store)
    server.add(kvstore_pb2_grpc.add_KvStoreServicer_to_server, servicer, ["yinian.v1.KvStore"])
    await server.start()
    metrics_port = metrics.serve_metrics(config.metrics_port, config.host, metrics.KVSTORE)
    bus = EventBus(config.nats_url, "kvstore")
    await bus.connect()
    await EventHandlers(index, events, bus).listen()
    if tier is not None:
        with contextlib.suppress(TierUnavailable):
            await tier.reconcile()
    await take_snapshot(store, events)
    await publish_shared(bus, events)
    await server.serving(True)
    print(f"READY kvstore {config.host}:{server.port} metrics {config.host}:{metrics_port}",
          flush=True)  # fmt: skip

    stop = stop_on_signals()
    housekeeping = Housekeeping(store, tier, events)
    last_housekeeping = last_gauges = last_reconcile = time.monotonic()
    while not stop.is_set():
        now = time.monotonic()
        if now - last_housekeeping >= HOUSEKEEPING_INTERVAL:
            last_housekeeping = now
            await housekeeping()
        if now - last_gauges >= GAUGE_INTERVAL:
            last_gauges = now
            await store.refresh_gauges()
        if tier is not None and now - last_reconcile >= RECONCILE_INTERVAL:
            last_reconcile = now
            with contextlib.suppress(TierUnavailable):
                await tier.reconcile()
        await publish_shared(bus, events)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=PUBLISH_INTERVAL)
    await server.serving(False)
    await server.stop(grace=1.0)
    await bus.close()
    if spilling is not None:
        spilling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await spilling
    if tier is not None:
        await tier.guard.close()
    if memory is not None:
        memory.close()
    shutdown_tracing()
