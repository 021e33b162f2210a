"""The engine's step, an object given its collaborators (scheduler, runner, KV
cache manager, tiers, disaggregation, timing): `launch` schedules a batch and
queues its forward pass and sampling on the device; `complete` reads the
sampled tokens back and applies them: the KV it wrote is committed, each token
goes through the output processor (the one place that detokenizes and checks
stop strings), and the scheduler frees or holds what finished.

A step is completed right after its launch, or, with async scheduling, during
the next `run()` after the next launch: the host
work of one step then overlaps the device work of the next, and each running
sequence's next input token is read on the device from the step that
sampled it (its `pending_token`). A sequence that follows a grammar runs ahead
too: its next step's mask waits for this step's token (engine/grammar.py), read
back while the device runs the next forward pass, and is filled on the mask
thread while this step is applied and the next batch scheduled; that step's draw
is queued (`sample.finish()`) once the next step's inputs are staged, just before
the next step reads its tokens (engine/step_inputs.py). A step is not run ahead of
when a sequence in it samples with penalties (they need every earlier token on
the host), forks (n > 1) or hands its KV off.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from engine.output_processor import RequestState, process_token
from engine.sampler import PendingSample
from engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Step:
    """One queued model step: its sequences, its sampled tokens (not yet read back)
    and whether the next step may be queued before they are."""

    seqs: list[Sequence]
    computed: list[int] | None = None  # each sequence's computed tokens once this step ran
    sample: PendingSample | None = None
    overlap: bool = False
    error: str | None = None
    timing: object | None = None  # the device's events around it, for one step in a few


class Stepper:
    """Runs the engine's steps over `requests` (the engine's request states, by id)."""

    def __init__(self, scheduler, runner, kv, tiers, disagg, timing, requests: dict,
                 *, async_scheduling: bool, pipeline_depth: int, max_model_len: int,
                 drafter=None):  # fmt: skip
        self.scheduler, self.runner, self.kv = scheduler, runner, kv
        self.tiers, self.disagg, self.timing = tiers, disagg, timing
        self.requests = requests
        # Pipeline parallel keeps a step in flight per stage, instead of running ahead.
        self.pipeline_depth = pipeline_depth
        # speculative decoding (engine/speculative.py), or None; its next step needs the
        # tokens this one kept, so it never runs ahead
        self.drafter = drafter
        self.async_scheduling = async_scheduling
        self.max_model_len = max_model_len
        self.inflight: Step | None = None  # queued on the device, not yet read back
        self.pipeline: deque[Step] = deque()

    @property
    def async_scheduling(self) -> bool:
        """Whether a step is read back during the next one (never with pipeline stages:
        they keep a step in flight per stage instead; never with drafts)."""
        return self._async_scheduling

    @async_scheduling.setter
    def async_scheduling(self, on: bool) -> None:
        self._async_scheduling = on and self.pipeline_depth == 1 and self.drafter is None

    def run(self) -> dict[str, RequestState]:
        """One step: launch a batch, complete what is due; returns the requests touched."""
        touched: dict[str, RequestState] = {}
        if self.pipeline_depth > 1:
            self._pipelined(touched)
            return touched
        launched = self.launch()
        done = [self.inflight] if self.inflight is not None else []
        self.inflight = None
        if launched is not None:
            if launched.overlap:
                self.inflight = launched
            else:
                done.append(launched)
        for step in done:
            self.complete(step, touched)
        return touched

    def has_work(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self.inflight is not None or bool(self.pipeline)

    def settle(self) -> None:
        """Blocks freed while the in-flight step runs may still receive its writes: it
        must be done before blocks taken now are written from outside its stream."""
        if self.inflight is not None and self.inflight.sample is not None:
            self.inflight.sample.wait()

    def drop(self) -> None:
        """Forgets queued steps (the engine is closing)."""
        self.inflight = None
        self.pipeline.clear()

    def housekeeping(self) -> bool:
        """Between steps, also when idle: ends expired leases and finished host-tier
        copies. True when blocks were freed."""
        freed = bool(self.disagg.expire())
        return self.tiers.housekeeping() or freed

    def launch(self) -> Step | None:
        """Schedules a batch and queues its step on the device (None: nothing to run)."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return None
        now = time.monotonic()
        for seq in batch.seqs:
            metrics = self.requests[seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        step = Step(batch.seqs)
        if self.pipeline_depth > 1:
            for seq in batch.seqs:
                seq.in_flight = True
        self.tiers.load_pending()  # host-tier prefix hits: copied in before the step reads them
        tables = [self.kv.block_ids(s) for s in batch.seqs]
        handoffs = self.disagg.finishing_handoffs(batch.seqs, batch.num_new_tokens)
        # layer-by-layer KV sends: called with each layer's index once it is written
        hook = self.disagg.layer_hook(handoffs) if handoffs else None
        try:
            start = self.timing.begin()
            step.sample = self.runner.launch(
                batch.seqs, batch.num_new_tokens, tables, layer_hook=hook
            )
            step.timing = self.timing.end(start)
        except Exception as exc:  # the step is lost; its requests end with the cause
            logger.exception("model step failed")
            step.error = f"model step failed: {exc}"
            return step
        finally:
            # The step before's draw, if its grammar masks held it back: queued by now
            # where this step reads its tokens (step_inputs, once this step's inputs
            # are staged), else here.
            if self.inflight is not None and self.inflight.sample is not None:
                self.inflight.sample.finish()
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        step.computed = [seq.num_computed_tokens for seq in batch.seqs]
        step.overlap = (
            self.async_scheduling
            and step.sample is not None
            and not handoffs
            and all(_may_run_ahead(seq) for seq in step.sample.seqs)
        )
        if step.overlap:
            for row, seq in enumerate(step.sample.seqs):
                seq.num_pending += 1
                seq.pending_token = (step.sample, row)
                if seq.grammar is not None:
                    seq.grammar.ahead = (step.sample, row)
        return step

    def _pipelined(self, touched: dict[str, RequestState]) -> None:
        """Pipeline parallel: keep one step in flight per stage, each over other
        sequences (a sequence's next step needs its last token): launch until the
        queue is full or nothing more can run, then complete the oldest."""
        queue = self.pipeline
        while len(queue) < self.pipeline_depth:
            step = self.launch()
            if step is None:
                break
            queue.append(step)
            if step.error is not None:
                break
        if queue:
            self.complete(queue.popleft(), touched)

    def complete(self, step: Step, touched: dict[str, RequestState]) -> None:
        """Reads a step's tokens back and applies them; requests whose blocks are held
        for a handoff get their lease."""
        for seq in step.seqs:
            seq.in_flight = False
        for seq in step.seqs:
            state = self.requests.get(seq.request_id)
            if state is not None and any(s is seq for s in state.seqs):  # not a reused id
                touched[seq.request_id] = state
        error, result = step.error, None
        if error is None and step.sample is not None:
            try:
                waited = time.perf_counter()
                step.sample.wait()
                waited = time.perf_counter() - waited
                result = step.sample.result()
                self.timing.done(step.timing, waited)
            except Exception as exc:  # a device error surfaces when the tokens are read
                logger.exception("model step failed")
                error = f"model step failed: {exc}"
        elif error is None:  # a step that sampled nothing (a prompt's chunk): counted, not timed
            self.timing.done(None, 0.0)
        if error is not None:
            for seq in step.seqs:
                if not seq.is_finished:
                    self.scheduler.fail(seq, error)
            return
        sampled = step.sample.seqs if result is not None else []
        if self.drafter is not None and result is not None:  # kept drafts; the rest rolled back
            rows = self.drafter.settle(sampled, result, step.seqs, step.computed)
        elif result is not None:
            rows = zip(sampled, result.token_ids, result.token_logprobs, result.logprobs)
        self.scheduler.commit(step.seqs, step.computed)
        if result is not None:
            self._apply(rows, step.overlap, touched)
        if self.drafter is not None:  # the next step's drafts (mtp: after every step)
            self.drafter.propose(list(dict.fromkeys(sampled)))
        self.housekeeping()  # back up what just became free; finish copies that are done

    def _apply(self, rows, pending: bool, touched) -> None:
        """Each sampled token, (seq, token, its logprob, top logprobs) in order, through
        the output processor (append, detokenize, stop checks); the first sequence of a
        request forks its siblings once it has its prompt; a finished sequence leaves
        the scheduler, or is held for a handoff."""
        held = []
        for seq, token, token_logprob, top in rows:
            if pending:
                seq.resolve_pending()
            if seq.is_finished:  # finished or aborted while this step ran: its token is moot
                continue
            if seq.index == 0:
                self.scheduler.fork_children(seq)
            process_token(seq, token, token_logprob, top, self.max_model_len)
            if not seq.is_finished:
                continue
            if self.drafter is not None:
                self.drafter.finished(seq)
            if self.scheduler.finished(seq):
                held.append(touched[seq.request_id])
        for state in held:
            self.disagg.hold(state, state.hold_seconds)


def _may_run_ahead(seq: Sequence) -> bool:
    """Whether the next step may be queued before this sequence's token is read
    back: not when its sampling needs earlier tokens on the host (penalties), its
    request forks (n > 1) or its blocks are held for a handoff. (A grammar's mask
    reads back the one token it needs.)"""
    return not seq.params.needs_penalties and seq.params.n == 1 and not seq.hold_blocks
