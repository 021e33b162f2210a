"""Placement: the ready worker that is least loaded, preferring one that
already holds the prompt's prefix; when every worker is saturated, say so
(the gateway answers 429 with Retry-After) instead of queueing without bound."""

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

    def capacity(self, w: WorkerState) -> int:
        extra = w.max_num_seqs if self.max_waiting is None else self.max_waiting
        return w.max_num_seqs + extra


@dataclass(slots=True)
class Decision:
    worker: WorkerState
    matched_blocks: int


def place(
    registry: Registry,
    index: KvIndex,
    policy: PlacementPolicy,
    block_hashes,
    exclude=(),
    roles=("colocated", "decode"),
) -> Decision:
    candidates = [w for w in registry.ready() if w.role in roles and w.worker_id not in exclude]
    if not candidates:
        raise WorkerUnavailable("no ready worker to serve the request")
    open_ = [w for w in candidates if w.load < policy.capacity(w)]
    if not open_:
        raise Saturated("every worker is at capacity", retry_after=policy.retry_after)

    def score(w: WorkerState) -> tuple[float, float]:
        hit_tokens = index.matched_blocks(w.worker_id, block_hashes) * w.block_size
        # A queued request costs about as much as recomputing ~a few blocks;
        # normalise load by capacity so workers of different sizes compare.
        load = w.load / policy.capacity(w)
        return (policy.prefix_weight * hit_tokens / 256.0 - load - 0.25 * w.kv_usage, -w.load)

    best = max(open_, key=score)
    best.pending += 1
    return Decision(best, index.matched_blocks(best.worker_id, block_hashes))
