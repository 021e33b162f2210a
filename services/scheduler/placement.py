"""Placement: the ready worker that is least loaded, preferring one that
already holds the prompt's prefix; when every worker is saturated, say so
(the gateway answers 429 with Retry-After) instead of queueing without bound.

Disaggregation is conditional: a request placed on a decode-role worker gets
a prefill worker too only when the part of its prompt the decode worker does
not already cache is at least `disagg_min_tokens` long; shorter prompts are
cheaper to prefill in place than to hand over.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import Saturated, WorkerUnavailable
from services.scheduler.kv_index import KvIndex
from services.scheduler.registry import Registry, WorkerState


@dataclass(slots=True)
class PlacementPolicy:
    max_waiting: int | None = None  # per worker beyond max_num_seqs; None: max_num_seqs
    prefix_weight: float = 1.0  # value of one cached prompt token against one queued request
    retry_after: float = 1.0
    disagg_min_tokens: int = 512

    def capacity(self, w: WorkerState) -> int:
        extra = w.max_num_seqs if self.max_waiting is None else self.max_waiting
        return w.max_num_seqs + extra


@dataclass(slots=True)
class Decision:
    worker: WorkerState
    matched_blocks: int
    prefill: WorkerState | None = None


def _best(
    workers: list[WorkerState], index: KvIndex, policy: PlacementPolicy, block_hashes
) -> WorkerState:
    def score(w: WorkerState) -> tuple[float, float]:
        hit_tokens = index.matched_blocks(w.worker_id, block_hashes) * w.block_size
        # A queued request costs about as much as recomputing ~a few blocks;
        # normalise load by capacity so workers of different sizes compare.
        load = w.load / policy.capacity(w)
        return (policy.prefix_weight * hit_tokens / 256.0 - load - 0.25 * w.kv_usage, -w.load)

    return max(workers, key=score)


def place(
    registry: Registry,
    index: KvIndex,
    policy: PlacementPolicy,
    block_hashes,
    prompt_tokens: int = 0,
    exclude=(),
    roles=("colocated", "decode"),
) -> Decision:
    candidates = [w for w in registry.ready() if w.role in roles and w.worker_id not in exclude]
    if not candidates:
        raise WorkerUnavailable("no ready worker to serve the request")
    open_ = [w for w in candidates if w.load < policy.capacity(w)]
    if not open_:
        raise Saturated("every worker is at capacity", retry_after=policy.retry_after)
    best = _best(open_, index, policy, block_hashes)
    best.pending += 1
    decision = Decision(best, index.matched_blocks(best.worker_id, block_hashes))
    uncached = prompt_tokens - decision.matched_blocks * best.block_size
    if best.role == "decode" and uncached >= policy.disagg_min_tokens:
        prefills = [
            w
            for w in registry.ready("prefill")
            if w.worker_id not in exclude and w.load < policy.capacity(w)
        ]
        if prefills:
            decision.prefill = _best(prefills, index, policy, block_hashes)
            decision.prefill.pending += 1
    return decision
