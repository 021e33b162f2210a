"""Which workers exist, which are ready, and how loaded each is.

Workers register over gRPC and then heartbeat with their NATS load reports;
one whose reports stop for `heartbeat_timeout` is dropped from placement.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class WorkerState:
    worker_id: str
    address: str
    role: str
    block_size: int
    max_num_seqs: int
    kv_blocks_total: int = 0
    host: str = ""
    transports: list[str] = field(default_factory=list)
    metrics_address: str = ""
    model: str = ""
    kv_layout: str = ""  # a handoff needs equal layouts on both ends
    parallel: bool = False  # tensor or pipeline parallel: rank 0 holds part of each block
    info: object = None  # the WorkerInfo it registered with, as ListWorkers shows it
    registered_at: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    pending: int = 0  # placed since the last load report, not yet in its counts
    reported: bool = False  # a load report came since it registered
    seq: int = 0  # its place in the registry's order (ties in placement go to the first)

    @property
    def load(self) -> int:
        return self.running + self.waiting + self.pending

    @classmethod
    def from_info(cls, info) -> WorkerState:
        """A worker as its WorkerInfo (what it registered with) describes it."""
        return cls(
            worker_id=info.worker_id,
            address=info.address,
            role=info.role or "colocated",
            block_size=info.block_size or 16,
            max_num_seqs=info.max_num_seqs or 256,
            kv_blocks_total=info.kv_blocks_total,
            host=info.host,
            transports=list(info.transports),
            metrics_address=info.metrics_address,
            model=info.model,
            kv_layout=info.kv_layout,
            parallel=info.tensor_parallel_size * info.pipeline_parallel_size > 1,
            info=info,
        )


class Registry:
    def __init__(self, heartbeat_timeout: float = 2.0, clock=time.monotonic, forget=None):
        """`forget(worker_id)`, if given, is called when a worker leaves (deregistered or
        expired) or registers again (a restart): what else was known of it goes too
        (a placer's KV index entries for it)."""
        self.heartbeat_timeout = heartbeat_timeout
        self.clock = clock
        self.forget = forget
        self.workers: dict[str, WorkerState] = {}
        self._seq = itertools.count()
        # What follows the workers' state (placement.OpenWorkers: its open workers and
        # their loads, kept as each worker's state changes instead of read from every
        # worker for every request): told each change. Change a worker's state only
        # through these methods.
        self.readers: list = []

    def register(self, state: WorkerState) -> bool:
        """Adds or replaces a worker; True when it replaced one (a restart)."""
        state.registered_at = state.last_seen = self.clock()
        old = self.workers.get(state.worker_id)
        state.seq = old.seq if old is not None else next(self._seq)
        self.workers[state.worker_id] = state
        self._changed(state.worker_id)
        if old is not None:
            self._forget(state.worker_id)  # a restart: its old cache is gone
        return old is not None

    def deregister(self, worker_id: str) -> WorkerState | None:
        state = self.workers.pop(worker_id, None)
        if state is not None:
            self._changed(worker_id)
            self._forget(worker_id)
        return state

    def placed(self, state: WorkerState) -> None:
        """A request was placed on `state` (counted until its next load report)."""
        state.pending += 1
        self._changed(state.worker_id)

    def _changed(self, worker_id: str) -> None:
        for reader in self.readers:
            reader.changed(worker_id)

    def _forget(self, worker_id: str) -> None:
        if self.forget is not None:
            self.forget(worker_id)

    def on_load(self, worker_id: str, running: int, waiting: int, kv_usage: float) -> bool:
        state = self.workers.get(worker_id)
        if state is None:
            return False  # not registered (yet, or any more): ignore
        state.last_seen = self.clock()
        state.reported = True
        state.running, state.waiting, state.kv_usage = running, waiting, kv_usage
        state.pending = 0
        self._changed(worker_id)
        return True

    def touch_all(self) -> None:
        """Counts every worker as just heard from (heartbeats cannot arrive now)."""
        now = self.clock()
        for state in self.workers.values():
            state.last_seen = now
            self._changed(state.worker_id)

    def is_ready(self, state: WorkerState) -> bool:
        return self.clock() - state.last_seen <= self.heartbeat_timeout

    def ready(self, role: str | None = None) -> list[WorkerState]:
        since = self.clock() - self.heartbeat_timeout  # one clock read for all of them
        return [
            w
            for w in self.workers.values()
            if w.last_seen >= since and (role is None or w.role == role)
        ]

    def why_dropped(self, state: WorkerState) -> str:
        """The log's reason for dropping a worker that missed its heartbeats."""
        why = f"no heartbeat for {self.heartbeat_timeout:.1f} s"
        if not state.reported:  # its reports go elsewhere, or it hangs from the start
            why += " (none since it registered: does it report on this scheduler's NATS?)"
        return why

    def expire(self) -> list[WorkerState]:
        """Drops workers that missed their heartbeats; returns them."""
        gone = [w for w in self.workers.values() if not self.is_ready(w)]
        for state in gone:
            del self.workers[state.worker_id]
            self._changed(state.worker_id)
            self._forget(state.worker_id)
        return gone
