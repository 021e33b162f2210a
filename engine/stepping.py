"""One model step in two halves: `launch` schedules a batch and queues its
forward pass and sampling on the device; `complete` reads the sampled tokens
back and applies them (append, stop checks, freeing what finished).

The engine completes a step right after launching it, or, with async
scheduling, during the next `step()` call after the next launch: the host
work of one step then overlaps the device work of the next, and each running
sequence's next input token is read on the device from the step that
sampled it (its `pending_token`). A step is not run ahead of when a sequence
in it samples with penalties (they need every earlier token on the host),
follows a grammar (its next mask needs this token on the host), forks (n > 1)
or hands its KV off.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from engine.output_processor import RequestState
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


def launch(engine) -> Step | None:
    """Schedules a batch and queues its step on the device (None: nothing to run)."""
    batch = engine.scheduler.schedule()
    if not batch.seqs:
        return None
    now = time.monotonic()
    for seq in batch.seqs:
        metrics = engine.requests[seq.request_id].metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = now
    step = Step(batch.seqs)
    if engine.pipeline_depth > 1:
        for seq in batch.seqs:
            seq.in_flight = True
    engine.tiers.load_pending()  # host-tier prefix hits: copied in before the step reads them
    tables = [engine.kv.block_ids(s) for s in batch.seqs]
    handoffs = engine.disagg.finishing_handoffs(batch.seqs, batch.num_new_tokens)
    try:
        if handoffs:  # layer-by-layer sends need the eager path's per-layer hook
            engine.runner.model.layer_hook = engine.disagg.layer_hook(handoffs)
        start = engine.timing.begin()
        step.sample = engine.runner.launch(
            batch.seqs, batch.num_new_tokens, tables, force_eager=bool(handoffs)
        )
        step.timing = engine.timing.end(start)
    except Exception as exc:  # the step is lost; its requests end with the cause
        logger.exception("model step failed")
        step.error = f"model step failed: {exc}"
        return step
    finally:
        engine.runner.model.layer_hook = None
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
    step.computed = [seq.num_computed_tokens for seq in batch.seqs]
    step.overlap = (
        engine.async_scheduling
        and step.sample is not None
        and not handoffs
        and all(_may_run_ahead(seq) for seq in step.sample.seqs)
    )
    if step.overlap:
        for row, seq in enumerate(step.sample.seqs):
            seq.num_pending += 1
            seq.pending_token = (step.sample.tokens, row)
    return step


def pipelined(engine, touched: dict[str, RequestState]) -> None:
    """Pipeline parallel: keep one step in flight per stage, each over other
    sequences (a sequence's next step needs its last token): launch until the
    queue is full or nothing more can run, then complete the oldest."""
    queue = engine.pipeline
    while len(queue) < engine.pipeline_depth:
        step = launch(engine)
        if step is None:
            break
        queue.append(step)
        if step.error is not None:
            break
    if queue:
        complete(engine, queue.popleft(), touched)


def _may_run_ahead(seq: Sequence) -> bool:
    """Whether the next step may be queued before this sequence's token is read
    back: not when its sampling needs earlier tokens on the host (penalties, a
    grammar's mask), its request forks (n > 1) or its blocks are held for a handoff."""
    return (
        not seq.params.needs_penalties
        and seq.grammar is None
        and seq.params.n == 1
        and not seq.hold_blocks
    )


def complete(engine, step: Step, touched: dict[str, RequestState]) -> None:
    """Reads a step's tokens back and hands them to the scheduler; requests whose
    blocks are held for a handoff get their lease."""
    for seq in step.seqs:
        seq.in_flight = False
    for seq in step.seqs:
        state = engine.requests.get(seq.request_id)
        if state is not None and any(s is seq for s in state.seqs):  # not a reused id
            touched[seq.request_id] = state
    error, result = step.error, None
    if error is None and step.sample is not None:
        try:
            waited = time.perf_counter()
            step.sample.wait()
            waited = time.perf_counter() - waited
            result = step.sample.result()
            engine.timing.done(step.timing, waited)
        except Exception as exc:  # a device error surfaces when the tokens are read
            logger.exception("model step failed")
            error = f"model step failed: {exc}"
    elif error is None:  # a step that sampled nothing (a prompt's chunk): counted, not timed
        engine.timing.done(None, 0.0)
    if error is not None:
        for seq in step.seqs:
            if not seq.is_finished:
                engine.scheduler.fail(seq, error)
        return
    sampled = step.sample.seqs if step.sample is not None else []
    held = engine.scheduler.update(step.seqs, step.computed, sampled, result, step.overlap)
    for seq in held:
        state = touched[seq.request_id]
        engine.disagg.hold(state, state.hold_seconds)
    engine.housekeeping()  # back up what just became free; finish copies that are done
