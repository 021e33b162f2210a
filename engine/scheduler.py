"""Continuous batching under a per-step token budget.

Each step first serves running sequences (a decode needs one token, a
sequence still in prefill gets its next chunk), then admits waiting ones in
policy order. When blocks run out, the lowest-priority running sequence is
preempted: its blocks are freed and it recomputes later (prompt plus the
tokens it already produced), so nothing is dropped and the step can always
make progress with one sequence, which the engine guarantees fits the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- queue management --------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Takes a sequence out of the queues and frees its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _order_key(self, seq: Sequence):
        if self.config.scheduling_policy == "priority":
            return (seq.priority, seq.arrival_time)
        return (0, seq.arrival_time)

    # -- one step ----------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=self._order_key)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = self._chunk(seq, seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new == 0 or seq.ends_by_length(self.max_model_len):
                i += 1
                continue
            while not self.kv.allocate_slots(seq, num_new):
                victim = self._pick_victim(batch, seq)
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1
                continue
            # `seq` itself was preempted; the list shifted under i
        if batch.preempted:
            return batch  # no admissions while memory is short
        self.waiting.sort(key=self._order_key)
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if seq.fork_parent is not None:
                continue  # forks when its parent's prompt is computed
            cached = self.kv.find_cached_prefix(seq)
            num_computed = len(cached) * self.kv.block_size
            num_new = self._chunk(seq, seq.num_tokens - num_computed, budget)
            if num_new == 0:
                break
            if not self.kv.allocate_slots(seq, num_new, cached):
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        return batch

    def _chunk(self, seq: Sequence, remaining: int, budget: int) -> int:
        """How many of the sequence's remaining tokens to compute this step (0: not now)."""
        if remaining <= 1:
            return min(remaining, budget)
        if not self.config.enable_chunked_prefill:
            return remaining if remaining <= budget else 0
        cap = self.config.max_prefill_chunk or remaining
        return min(remaining, budget, cap)

    def _pick_victim(self, batch: ScheduledBatch, current: Sequence) -> Sequence:
        """The lowest-priority running sequence not yet in this step's batch, else `current`."""
        candidates = [s for s in self.running if s is not current and s not in batch.seqs]
        if not candidates:
            return current
        return max(candidates, key=self._order_key)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        batch.preempted.append(seq)
