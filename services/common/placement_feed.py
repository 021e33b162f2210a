"""What keeps a placer's registry and KV index current from NATS: the workers'
load reports (their heartbeats), their KV events and the shared tier's. A
numbered batch that reveals a gap is counted and asks its holder to resync (it
answers with a reset batch, which every listener applies). The scheduler and a
gateway that places requests itself both listen this way."""

from __future__ import annotations

from proto.yinian.v1 import common_pb2
from services.common.bus import KV_RESYNC_SUBJECT, SHARED_KV_SUBJECT, kv_subject, load_subject
from services.common.kv_index import GPU, HOST, SHARED, SHARED_HOLDER, KvIndex
from services.common.registry import Registry


class PlacementFeed:
    """Applies the NATS events to `registry` and `index`; `gaps` counts the gaps
    found, by holder (a Prometheus counter with a `holder` label, or None)."""

    def __init__(self, registry: Registry, index: KvIndex, bus, gaps=None):
        self.registry, self.index, self.bus, self.gaps = registry, index, bus, gaps

    async def on_load(self, report: common_pb2.LoadReport, headers) -> bool:
        """Applies a load report; False when its worker is not registered here. A
        draining worker leaves placement at once (True: it is not to come back)."""
        if report.draining:
            self.registry.deregister(report.worker_id)  # its KV entries go with it
            return True
        return self.registry.on_load(
            report.worker_id,
            report.num_requests_running,
            report.num_requests_waiting,
            report.kv_cache_usage,
        )

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
        if self.index.gaps > gaps and self.gaps is not None:
            self.gaps.labels(holder=holder).inc()
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
