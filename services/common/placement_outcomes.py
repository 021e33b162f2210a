"""What a placer (the scheduler, or a gateway placing requests itself) answers
and counts: the scheduler's placement settings as `ListWorkers` carries them to
a gateway (`settings_of`, `policy_of`: the one mapping, both ways), and of each
placement: its outcome, the cached prefix it chose against
the longest one open, a prefill worker refused for its KV layout, and prompts
hashed in blocks of another size than the chosen worker caches (said once per
pair of sizes)."""

from __future__ import annotations

import logging

from proto.yinian.v1 import scheduler_pb2
from services.common.placement import Decision, PlacementPolicy

logger = logging.getLogger(__name__)


def settings_of(
    policy: PlacementPolicy, heartbeat_timeout: float
) -> scheduler_pb2.PlacementSettings:
    """The PlacementSettings that describe `policy` (and the scheduler's heartbeat
    timeout)."""
    return scheduler_pb2.PlacementSettings(
        max_waiting=policy.max_waiting,
        request_tokens=policy.request_tokens,
        memory_tokens=policy.memory_tokens,
        host_hit_weight=policy.host_hit_weight,
        shared_hit_weight=policy.shared_hit_weight,
        retry_after_seconds=policy.retry_after,
        disagg_min_tokens=policy.disagg_min_tokens,
        heartbeat_timeout_seconds=heartbeat_timeout,
    )


def policy_of(settings: scheduler_pb2.PlacementSettings) -> PlacementPolicy:
    """The PlacementPolicy that `settings` describe (settings_of's inverse)."""
    return PlacementPolicy(
        max_waiting=settings.max_waiting if settings.HasField("max_waiting") else None,
        request_tokens=settings.request_tokens,
        memory_tokens=settings.memory_tokens,
        host_hit_weight=settings.host_hit_weight,
        shared_hit_weight=settings.shared_hit_weight,
        retry_after=settings.retry_after_seconds,
        disagg_min_tokens=settings.disagg_min_tokens,
    )


def answer(decision: Decision) -> scheduler_pb2.Placement:
    """The Placement message of `decision`."""
    out = scheduler_pb2.Placement(
        worker_id=decision.worker.worker_id,
        address=decision.worker.address,
        matched_blocks=decision.matched_blocks,
    )
    if decision.prefill is not None:
        out.prefill_worker_id = decision.prefill.worker_id
        out.prefill_address = decision.prefill.address
    return out


class Outcomes:
    def __init__(self, placements, prefix_blocks):
        self.placements, self.prefix_blocks = placements, prefix_blocks
        self._mismatches: set[tuple[int, int]] = set()  # (hashed, cached) block sizes said

    def failed(self, exc: Exception) -> None:
        self.placements.labels(outcome=type(exc).__name__).inc()

    def placed(self, decision: Decision, hashed_block_size: int) -> None:
        """Counts `decision`; `hashed_block_size`: the blocks the prompt was hashed in
        (0: not said)."""
        self.placements.labels(outcome="placed").inc()
        self.prefix_blocks.labels(kind="chosen").inc(decision.matched_blocks)
        self.prefix_blocks.labels(kind="longest").inc(decision.longest_blocks)
        worker = decision.worker
        if hashed_block_size and hashed_block_size != worker.block_size:
            self._block_size_mismatch(hashed_block_size, worker)
        if decision.refused_prefills and decision.prefill is None:
            self.placements.labels(outcome="prefill_layout_mismatch").inc()

    def _block_size_mismatch(self, hashed: int, worker) -> None:
        """The gateway hashed the prompt in blocks of another size than the worker's:
        no prefix can match (prefix-aware placement is off in all but name). Counted
        every time, said once per pair of sizes."""
        self.placements.labels(outcome="block_size_mismatch").inc()
        if (hashed, worker.block_size) not in self._mismatches:
            self._mismatches.add((hashed, worker.block_size))
            logger.warning(
                "the gateway hashes prompts in blocks of %d tokens, worker %s caches blocks "
                "of %d: no cached prefix can be found; give the gateway --block-size %d",
                hashed, worker.worker_id, worker.block_size, worker.block_size,
            )  # fmt: skip
