"""The simulation: a trace's requests arrive, the scheduler's own placement
(`services/common/placement.py`, its registry and KV index, in this process
and on the simulation's clock) picks a worker for each, and simulated workers
run them; load reports and KV events reach the scheduler as a worker's would
(a load report at most every `load_interval`, KV events every `kv_interval`,
and both when a worker falls idle).

Time is the simulation's, not the machine's: a thousand workers and a hundred
thousand requests take what the Python takes, minutes on a small machine. Each
placement's own wall time is measured (the real code, at the real number of
workers). A request reaches its worker `service_ms` after it arrives (the
mesh's services on the GPU's host, from the device profile) and its first token
is counted from its arrival; what the services do is not simulated beyond that.

The scheduler is one process: a placement begins when the one before it has
ended and takes its measured wall time, so the scheduler's own speed limits
how many requests a second a mesh can take (as it would). With `placement_ms`
it takes that fixed time instead, and a run repeats exactly (a measured time
shifts events by microseconds, which can move a request to another worker).

Placement `kv`: the scheduler's (prefix-aware, load-weighed). `round-robin`:
the next worker in turn that is not at capacity, for comparison."""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

from services.common.errors import Saturated, WorkerUnavailable
from services.common.kv_index import GPU, KvIndex
from services.common.placement import PlacementPolicy, place
from services.common.registry import Registry, WorkerState
from yinian.sim.worker import SimRequest, SimWorker

PLACEMENTS = ("kv", "round-robin")
_ARRIVE, _DELIVER, _STEP, _MARK = 0, 1, 2, 3


@dataclass
class SimConfig:
    workers: int
    placement: str = "kv"
    capacity_blocks: int = 1455  # llama3-8b on an H200: ~91 GiB of KV, 512-token blocks
    block_tokens: int = 512
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    service_ms: float = 0.0
    load_interval: float = 0.5
    kv_interval: float = 0.02
    policy: PlacementPolicy = field(default_factory=PlacementPolicy)
    # a placement's time on the simulation's clock: its measured wall time (None), or
    # this many ms (a run that repeats exactly; the wall time is still reported)
    placement_ms: float | None = None

    def __post_init__(self) -> None:
        if self.placement_ms is not None and self.placement_ms < 0:
            raise ValueError(f"placement_ms must be >= 0, got {self.placement_ms}")
        if self.workers < 1:
            raise ValueError(f"the simulation needs at least one worker, got {self.workers}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")


@dataclass
class SimResult:
    requests: list[SimRequest]
    refused: int  # saturated: every worker at capacity (the gateway's 429)
    too_long: int  # a prompt and output no worker's pool can hold
    placement_seconds: list[float]  # wall time of each placement
    workers: list[SimWorker]
    end: float  # when the last request finished (simulated seconds)
    last_arrival: float
    tokens_by_last_arrival: int  # output tokens made while requests still came
    scheduler_busy: float  # the share of the arrivals' span the scheduler spent placing
    wall_seconds: float


class Cluster:
    def __init__(self, config: SimConfig, model):
        self.config = config
        self.now = 0.0
        self.index = KvIndex()
        self.registry = Registry(heartbeat_timeout=float("inf"), clock=lambda: self.now,
                                 forget=self.index.forget)  # fmt: skip
        self.workers: dict[str, SimWorker] = {}
        self.events: list = []
        self._seq = itertools.count()
        self._turn = 0
        self._reported: dict[str, float] = {}
        self._published: dict[str, float] = {}
        self._event_ids: dict[str, int] = {}
        self.model = model
        self._ids = itertools.count()
        self.gpu_seconds = 0.0  # workers powered (serving, draining, starting) × time
        self.stopped: dict[str, SimWorker] = {}  # drained and powered off
        self.finished: list[SimRequest] = []  # in the order they finished
        self.starting = 0  # workers started, not yet serving
        for _ in range(config.workers):
            self.add_worker()

    def add_worker(self) -> SimWorker:
        """A worker that serves from now on."""
        c, i = self.config, next(self._ids)
        wid = f"worker-{i}"
        worker = self.workers[wid] = SimWorker(wid, self.model, c.capacity_blocks,
                                               c.block_tokens, c.max_num_seqs,
                                               c.max_num_batched_tokens)  # fmt: skip
        self.registry.register(WorkerState(wid, f"sim:{i}", "colocated",
                                           block_size=c.block_tokens,
                                           max_num_seqs=c.max_num_seqs,
                                           kv_blocks_total=c.capacity_blocks))  # fmt: skip
        self.index.apply(wid, 0, {GPU: ([], [])}, reset=True)
        self._event_ids[wid] = 0
        self._order = list(self.registry.workers.values())
        return worker

    def drain_worker(self, worker_id: str) -> None:
        """No more placements on it; it finishes what it holds, then powers off."""
        self.registry.deregister(worker_id)  # and the index forgets it
        self._order = list(self.registry.workers.values())
        worker = self.workers[worker_id]
        if not worker.busy:
            self._step(worker)  # idle: powers off now

    def _push(self, at: float, kind: int, payload) -> None:
        heapq.heappush(self.events, (at, next(self._seq), kind, payload))

    def on_event(self, kind: int, payload) -> None:
        """An event of a kind a subclass pushed (the planner's)."""
        raise ValueError(f"unknown simulation event {kind}")

    def run(self, requests: list[SimRequest]) -> SimResult:
        began = time.perf_counter()
        size, capacity = self.config.block_tokens, self.config.capacity_blocks
        too_long = 0
        for r in requests:
            if -(-(r.input_len + r.output_len) // size) > capacity:
                too_long += 1
                continue
            self._push(r.arrival, _ARRIVE, r)
        last = max((r.arrival for r in requests), default=0.0)
        self._push(last, _MARK, None)
        refused, timings, marked = 0, [], 0
        finished = self.finished
        service = self.config.service_ms / 1e3
        free_at = 0.0  # when the scheduler is done with the placements so far
        while self.events:
            at, _, kind, payload = heapq.heappop(self.events)
            self.gpu_seconds += (len(self.workers) + self.starting) * (at - self.now)
            self.now = at
            if kind == _ARRIVE:
                started = time.perf_counter()
                worker = self._place(payload)
                took = time.perf_counter() - started
                timings.append(took)
                if self.config.placement_ms is not None:
                    took = self.config.placement_ms / 1e3
                free_at = max(free_at, self.now) + took
                payload.placed = free_at
                if worker is None:
                    refused += 1
                else:
                    self._push(free_at + service, _DELIVER, (worker, payload))
            elif kind == _DELIVER:
                worker, request = payload
                if worker.worker_id not in self.workers:  # placed before it drained
                    self.stopped.pop(worker.worker_id)
                    self.workers[worker.worker_id] = worker
                worker.add(request)
                if not worker.busy:
                    self._step(worker)
            elif kind == _STEP:
                finished += payload.end_step(self.now)
                self._step(payload)
            elif kind == _MARK:
                marked = sum(w.output_tokens for w in self.workers.values())
            else:
                self.on_event(kind, payload)
        busy = sum(timings) / last if last > 0 else 0.0
        return SimResult(finished, refused, too_long, timings, self.every_worker(),
                         self.now, last, marked, busy, time.perf_counter() - began)  # fmt: skip

    def _place(self, request: SimRequest) -> SimWorker | None:
        if self.config.placement == "round-robin":
            return self._round_robin()
        try:
            decision = place(self.registry, self.index, self.config.policy, request.hashes,
                             request.input_len)  # fmt: skip
        except (Saturated, WorkerUnavailable):  # every worker full, or none serving
            return None
        return self.workers[decision.worker.worker_id]

    def _round_robin(self) -> SimWorker | None:
        n = len(self._order)
        for k in range(n):
            state = self._order[(self._turn + k) % n]
            if state.load < self.config.policy.capacity(state):
                self._turn = (self._turn + k + 1) % n
                self.registry.placed(state)
                return self.workers[state.worker_id]
        return None

    def every_worker(self) -> list[SimWorker]:
        """Those powered now and those powered off since (what each served counts)."""
        return list(self.workers.values()) + list(self.stopped.values())

    def _step(self, worker: SimWorker) -> None:
        seconds = worker.start_step() if worker.has_work() else 0.0
        if seconds > 0:
            self._push(self.now + seconds, _STEP, worker)
        idle = seconds == 0
        wid = worker.worker_id
        if idle and wid not in self.registry.workers:  # drained: powers off
            self.stopped[wid] = self.workers.pop(wid)
            return
        if idle or self.now - self._published.get(wid, -1.0) >= self.config.kv_interval:
            self._publish(worker)
        if idle or self.now - self._reported.get(wid, -1.0) >= self.config.load_interval:
            self._reported[wid] = self.now
            waiting = len(worker.waiting)
            self.registry.on_load(wid, worker.running, waiting, worker.pool.used())

    def _publish(self, worker: SimWorker) -> None:
        wid = worker.worker_id
        self._published[wid] = self.now
        stored, removed = worker.pool.take_events()
        if stored or removed:
            self._event_ids[wid] += 1
            self.index.apply(wid, self._event_ids[wid], {GPU: (stored, removed)})
