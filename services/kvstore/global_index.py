"""The global index: which worker holds which block in its GPU or host tier,
kept from the workers' KvEvents on NATS (services/common/kv_index.py does the
bookkeeping). A gap in a worker's numbering makes the index ask that worker
for a reset batch (KvResync), at most once per `resync_interval`; a worker
whose load reports and events stop for `worker_timeout` is forgotten."""

from __future__ import annotations

import time
from collections.abc import Callable

from services.common.kv_index import GPU, HOST, KvIndex


class GlobalIndex:
    def __init__(
        self,
        worker_timeout: float = 10.0,
        resync_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.index = KvIndex()
        self.worker_timeout = worker_timeout
        self.resync_interval = resync_interval
        self.clock = clock
        self.last_seen: dict[str, float] = {}
        self._resync_asked: dict[str, float] = {}

    def on_events(
        self,
        worker_id: str,
        event_id: int,
        gpu: tuple[list[int], list[int]],
        host: tuple[list[int], list[int]],
        reset: bool,
    ) -> bool:
        """Applies one KvEvents batch; True when the worker should be asked to
        resync (a gap, or events from a worker the index has no snapshot of)."""
        self.last_seen[worker_id] = self.clock()
        if self.index.apply(worker_id, event_id, {GPU: gpu, HOST: host}, reset):
            self._resync_asked.pop(worker_id, None)
            return False
        now = self.clock()
        asked = self._resync_asked.get(worker_id)
        if asked is not None and now - asked < self.resync_interval:
            return False
        self._resync_asked[worker_id] = now
        return True

    def on_load(self, worker_id: str) -> None:
        if worker_id in self.last_seen:
            self.last_seen[worker_id] = self.clock()

    def expire(self) -> list[str]:
        """Forgets workers silent for `worker_timeout`; returns them."""
        now = self.clock()
        gone = [w for w, seen in self.last_seen.items() if now - seen > self.worker_timeout]
        for worker_id in gone:
            self.index.forget(worker_id)
            del self.last_seen[worker_id]
            self._resync_asked.pop(worker_id, None)
        return gone

    def holders(self, block_hash: int) -> list[tuple[str, str]]:
        """(worker, tier) pairs holding the block: GPU tiers first, then host."""
        found = [(w, t) for w, t in self.index.holders(block_hash) if t in (GPU, HOST)]
        return sorted(found, key=lambda wt: (wt[1] != GPU, wt[0]))

    def sizes(self) -> dict[str, int]:
        """Blocks per worker tier, summed over workers."""
        return {
            tier: sum(self.index.num_blocks(w, tier) for w in self.last_seen)
            for tier in (GPU, HOST)
        }
