"""A simulated engine worker: continuous batching as the engine does it (every
decoding request a row of each step, prompts prefilled in chunks within the
step's token budget, requests admitted first come first served while a
sequence slot and their blocks are free), each step as long as the fitted
device model says (`engine/step_time_model.py`), over a `BlockPool`.

The worker keeps totals, not rows: a step's decode rows and the tokens in their
caches grow by one a row a step, and a request ends at a known step, so a step
costs the simulator the same whatever its batch."""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from bench.loadgen.traces import TraceEntry
from engine.step_time_model import StepTimeModel
from yinian.sim.block_pool import BlockPool


@dataclass(slots=True, eq=False)
class SimRequest:
    rid: int
    arrival: float  # at the gateway, seconds
    input_len: int
    output_len: int
    hashes: tuple[int, ...]  # the prompt's blocks
    blocks: int = 0  # what it holds: prompt and output
    matched: int = 0  # leading prompt blocks found cached at admission
    todo: int = 0  # prompt tokens still to compute
    computed: int = 0  # prompt tokens computed so far (cached ones included)
    placed: float | None = None  # when the scheduler had placed it (its queue and its time)
    first_token: float | None = None
    finished: float | None = None
    join_step: int = 0  # the worker's step count when it began decoding
    worker: str = ""


def entries_of(rows: list[dict]) -> list[TraceEntry]:
    """`make_trace`'s rows as a trace file's entries."""
    return [TraceEntry(float(r["timestamp"]), r["input_length"], r["output_length"],
                       tuple(r["hash_ids"])) for r in rows]  # fmt: skip


def sim_requests(entries: list[TraceEntry], shift_ms: float = 0.0,
                 first_id: int = 0) -> list[SimRequest]:  # fmt: skip
    """Fresh requests of a trace's entries (a run changes them), arriving `shift_ms`
    after their timestamps, numbered from `first_id`."""
    return [SimRequest(first_id + i, (e.timestamp_ms + shift_ms) / 1e3, e.input_length,
                       e.output_length, tuple(e.hash_ids))
            for i, e in enumerate(entries)]  # fmt: skip


def ttfts_ms(requests) -> list[float]:
    return [(r.first_token - r.arrival) * 1e3 for r in requests]


def itls_ms(requests) -> list[float]:
    """Each request's mean time between its tokens after the first."""
    return [(r.finished - r.first_token) / (r.output_len - 1) * 1e3
            for r in requests if r.output_len > 1]  # fmt: skip


class SimWorker:
    def __init__(
        self,
        worker_id: str,
        model: StepTimeModel,
        capacity_blocks: int,
        block_tokens: int,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
    ):
        self.worker_id = worker_id
        self.model = model
        self.pool = BlockPool(capacity_blocks)
        self.block_tokens = block_tokens
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.decoding: list[tuple[int, int, SimRequest]] = []  # (last step, rid, request)
        self.context = 0  # tokens in the decoding rows' caches
        self.steps = 0
        self.busy = False  # a step is in flight
        self.output_tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self._chunks: list[tuple[SimRequest, int]] = []  # the step in flight's chunks

    # -- what the scheduler sees ----------------------------------------------
    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    def add(self, request: SimRequest) -> None:
        request.worker = self.worker_id
        self.waiting.append(request)

    # -- a step ---------------------------------------------------------------
    def start_step(self) -> float:
        """Forms the next step and returns its length in seconds (0: nothing to run)."""
        self._admit()
        decode_rows = len(self.decoding)
        budget = self.budget - decode_rows
        chunks = []
        for r in self.prefilling:
            if budget <= 0:
                break
            n = min(r.todo, budget)
            chunks.append((r, n))
            budget -= n
        self._chunks = chunks
        seconds = self.model.step_seconds(
            decode_rows, self.context + decode_rows, [(n, r.computed) for r, n in chunks]
        )
        self.busy = seconds > 0
        return seconds

    def end_step(self, now: float) -> list[SimRequest]:
        """The step in flight ends at `now`: its tokens are out. Returns the
        requests that finished."""
        self.busy = False
        rows = len(self.decoding)
        self.steps += 1
        self.context += rows
        self.output_tokens += rows
        done = []
        while self.decoding and self.decoding[0][0] <= self.steps:
            _, _, r = heapq.heappop(self.decoding)
            self.context -= r.input_len + (self.steps - r.join_step)
            done.append(self._finish(r, now))
        for r, n in self._chunks:
            r.todo -= n
            r.computed += n
            if r.todo:
                continue
            self.prefilling.remove(r)
            self.pool.prompt_done(r.hashes, r.matched)
            r.first_token = now
            self.output_tokens += 1
            if r.output_len == 1:
                done.append(self._finish(r, now))
                continue
            r.join_step = self.steps
            self.context += r.input_len
            heapq.heappush(self.decoding, (self.steps + r.output_len - 1, r.rid, r))
        self._chunks = []
        return done

    def _admit(self) -> None:
        pool, size = self.pool, self.block_tokens
        while self.waiting and self.running < self.max_num_seqs:
            r = self.waiting[0]
            matched = pool.cached_prefix(r.hashes)
            # one prompt token is always computed (its logits give the first token)
            cached = min(matched * size, r.input_len - 1)
            matched = cached // size
            blocks = -(-(r.input_len + r.output_len) // size)
            if not pool.admit(r.hashes, matched, blocks):
                break  # it waits for blocks; those behind it wait with it (FCFS)
            self.waiting.popleft()
            r.matched, r.blocks = matched, blocks
            r.computed = matched * size
            r.todo = r.input_len - r.computed
            self.prompt_tokens += r.input_len
            self.cached_tokens += r.computed
            self.prefilling.append(r)

    def _finish(self, r: SimRequest, now: float) -> SimRequest:
        r.finished = now
        self.pool.release(r.hashes, len(r.hashes), r.blocks)
        return r
