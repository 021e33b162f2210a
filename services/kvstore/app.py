"""The KV store's process: the gRPC server (Lookup, Put, Get, Stats, the
same-host calls), the NATS subscription to KvResync requests for the shared
tier, and the loop that publishes the shared tier's SharedKvEvents and rebuilds
after Redis comes back. Which worker holds which block is the scheduler's index,
not the store's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from proto.yinian.v1 import common_pb2, kvstore_pb2_grpc
from services.common import metrics
from services.common.bus import KV_RESYNC_SUBJECT, SHARED_KV_SUBJECT, EventBus
from services.common.entry import stop_on_signals
from services.common.grpc_server import GrpcServer
from services.common.kv_index import SHARED_HOLDER
from services.common.telemetry import setup_tracing, shutdown_tracing
from services.kvstore.config import KvStoreConfig
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


async def listen_for_resyncs(bus: EventBus, events: SharedEventLog) -> None:
    """A KvResync for the shared tier (or for everyone) queues a reset batch."""

    def on_resync(request: common_pb2.KvResync, headers) -> None:
        if request.worker_id in ("", SHARED_HOLDER):
            events.reset_wanted = True

    await bus.subscribe(KV_RESYNC_SUBJECT, common_pb2.KvResync, on_resync)


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
    """Once a second: follow Redis going down and coming back, and queue the
    snapshots that follow."""

    def __init__(self, store: KvStore, tier: SharedTier | None, events: SharedEventLog):
        self.store, self.tier, self.events = store, tier, events
        self.announced_down = False

    async def __call__(self) -> None:
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
    tier, memory, spiller = build_tiers(config, ledger, events)
    store = KvStore(tier, ledger, config.max_block_bytes, memory)
    spilling = asyncio.create_task(spiller.drain()) if spiller is not None else None
    server = GrpcServer(config.host, config.port, config.tls_files())
    servicer = KvStoreServicer(store)
    server.add(kvstore_pb2_grpc.add_KvStoreServicer_to_server, servicer, ["yinian.v1.KvStore"])
    await server.start()
    metrics_port = metrics.serve_metrics(config.metrics_port, config.host, metrics.KVSTORE)
    bus = EventBus(config.nats_url, "kvstore")
    await bus.connect()
    await listen_for_resyncs(bus, events)
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
