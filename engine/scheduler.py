"""Continuous batching under a per-step token budget.

Each step first serves running sequences (a decode needs one token, a
sequence still in prefill gets its next chunk), then admits waiting ones in
policy order. When blocks run out, the lowest-priority running sequence is
preempted: its blocks are freed and it recomputes later (prompt plus the
tokens it already produced), so nothing is dropped and the step can always
make progress with one sequence, which the engine guarantees fits the pool.

The scheduler owns its queues: `waiting` and `running` are read-only views,
and only its methods move a sequence between them — `add`, `schedule`,
`update` (a step's sampled tokens: appends, forks, finishes, holds), `fail`,
`remove`, and `resume_prefilled` (a prompt whose KV was filled from outside).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.sequence import FinishReason, Sequence, SequenceStatus


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
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []
        self.num_preemptions = 0
        self.pipeline_depth = config.pipeline_parallel_size  # steps in flight at once

    # -- queues ----------------------------------------------------------------
    @property
    def waiting(self) -> tuple[Sequence, ...]:
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[Sequence, ...]:
        return tuple(self._running)

    @property
    def num_unfinished(self) -> int:
        return len(self._waiting) + len(self._running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Takes a sequence out of the queues and frees its blocks (finish or abort)."""
        self._discard(seq)
        self.kv.free(seq)

    def resume_prefilled(self, seq: Sequence) -> None:
        """A sequence whose prompt KV was filled from outside (and its first token
        appended) joins the running batch."""
        seq.status = SequenceStatus.RUNNING
        self._running.append(seq)

    def _discard(self, seq: Sequence) -> None:
        if seq in self._running:
            self._running.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)

    def _order_key(self, seq: Sequence):
        if self.config.scheduling_policy == "priority":
            return (seq.priority, seq.arrival_time)
        return (0, seq.arrival_time)

    # -- one step ----------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        self._running.sort(key=self._order_key)
        i = 0
        # A pipeline of P stages runs P steps at once over different sequences: each
        # step takes about 1/P of them, so the next stage never waits for work.
        share = -(-self.num_unfinished // self.pipeline_depth)
        while i < len(self._running) and budget > 0 and len(batch.seqs) < share:
            seq = self._running[i]
            if seq.in_flight:  # in a pipelined step still running: not again until read back
                i += 1
                continue
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
            self._add_drafts(batch, 0)  # no admissions and no drafts while memory is short
            return batch
        self._waiting.sort(key=self._order_key)
        for seq in list(self._waiting):
            if budget <= 0 or len(self._running) >= self.config.max_num_seqs:
                break
            if len(batch.seqs) >= share:
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
            self._waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        self._add_drafts(batch, budget)
        return batch

    def _add_drafts(self, batch: ScheduledBatch, budget: int) -> None:
        """Speculative decoding: a one-token decode verifies its drafts in the budget and
        the free blocks nothing else in the step needed (earlier sequences first; drafts
        never preempt). A scheduled sequence whose drafts do not fit drops them."""
        for j, seq in enumerate(batch.seqs):
            drafts = seq.draft_token_ids
            if not drafts:
                continue
            del drafts[max(0, budget) :]
            if batch.num_new_tokens[j] != 1 or not drafts:
                seq.draft_token_ids = []
            elif self.kv.allocate_slots(seq, 1 + len(drafts)):
                batch.num_new_tokens[j] += len(drafts)
                budget -= len(drafts)
            else:
                seq.draft_token_ids = []

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
        candidates = [
            s for s in self._running if s is not current and s not in batch.seqs and not s.in_flight
        ]
        if not candidates:
            return current
        return max(candidates, key=self._order_key)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self._running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._waiting.append(seq)
        batch.preempted.append(seq)

    # -- after a step ------------------------------------------------------------
    def commit(self, seqs: list[Sequence], computed: list[int]) -> None:
        """Publishes the blocks a finished step wrote (KV commit). `computed` is each
        sequence's computed-token count as of that step (a later one may be running)."""
        for seq, num_computed in zip(seqs, computed):
            if not seq.is_finished:
                self.kv.commit(seq, num_computed)

    def finished(self, seq: Sequence) -> bool:
        """A sequence finished: it leaves with its blocks freed, or, when its blocks are
        held for a handoff, leaves the queues with them kept (returns True)."""
        if seq.hold_blocks and seq.finish_reason != FinishReason.ERROR:
            self._discard(seq)
            return True
        self.remove(seq)
        return False

    def fail(self, seq: Sequence, error: str) -> None:
        """Ends a sequence with an error; siblings waiting to fork from it compute alone."""
        self.remove(seq)
        seq.finish(FinishReason.ERROR, error=error)
        for sibling in self._waiting:
            if sibling.fork_parent is seq:
                sibling.fork_parent = None

    def fork_children(self, parent: Sequence) -> None:
        """The siblings waiting for a request's first sequence share its prompt now."""
        for child in [s for s in self._waiting if s.fork_parent is parent]:
            self._waiting.remove(child)
            self.kv.fork(parent, child)
            child.fork_parent = None
            child.status = SequenceStatus.RUNNING
            self._running.append(child)
