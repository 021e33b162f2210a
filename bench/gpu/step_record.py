"""Each engine step's make-up and times, for the GPU scripts: its prompt tokens and
decoding sequences (from the scheduler's batch), the engine thread's time in its
launch (scheduling, inputs, queueing the forward pass) and in completing it (its
tokens applied, outputs made) less the wait for the device, that wait, and the
device's own time (every step timed while recording; a step that samples nothing,
a long prompt's middle chunk, has none). `summary` groups the steps: those with
prompt tokens, and decode-only steps by how many sequences they decode.

    with StepRecorder(llm.engine) as rec:
        ...steps...
    rec.summary()
"""

from __future__ import annotations

import time
from dataclasses import dataclass

DECODE_BUCKETS = (16, 32, 64, 128, 256, 1 << 30)


@dataclass
class StepTimes:
    prompt: int
    decoding: int
    launch_ms: float
    complete_ms: float = 0.0  # the thread's own time, the wait left out
    wait_ms: float = 0.0
    device_ms: float | None = None


class StepRecorder:
    def __init__(self, engine):
        self.engine = engine
        self.steps: list[StepTimes] = []

    def __enter__(self) -> StepRecorder:
        engine, stepper, timing = self.engine, self.engine.stepper, self.engine.timing
        schedule, launch, complete, done = (
            engine.scheduler.schedule, stepper.launch, stepper.complete, timing.done
        )  # fmt: skip
        self._every, timing.every = timing.every, 1
        batch_of: list = [None]
        by_step: dict[int, StepTimes] = {}
        current: list[StepTimes | None] = [None]

        def scheduled():
            batch_of[0] = schedule()
            return batch_of[0]

        def launched():
            start = time.perf_counter()
            step = launch()
            if step is not None:
                new = batch_of[0].num_new_tokens
                rec = StepTimes(sum(n for n in new if n > 1), sum(1 for n in new if n == 1),
                                (time.perf_counter() - start) * 1e3)  # fmt: skip
                self.steps.append(rec)
                by_step[id(step)] = rec
            return step

        def completed(step, touched):
            rec = current[0] = by_step.pop(id(step), None)
            start = time.perf_counter()
            try:
                return complete(step, touched)
            finally:
                if rec is not None:
                    rec.complete_ms = (time.perf_counter() - start) * 1e3 - rec.wait_ms
                current[0] = None

        def timed(events, waited):
            before = timing.device_seconds
            done(events, waited)
            rec = current[0]
            if rec is not None:
                rec.wait_ms = waited * 1e3
                if events is not None:
                    rec.device_ms = (timing.device_seconds - before) * 1e3

        engine.scheduler.schedule, stepper.launch = scheduled, launched
        stepper.complete, timing.done = completed, timed
        return self

    def __exit__(self, *exc) -> None:
        engine = self.engine
        for obj, name in ((engine.scheduler, "schedule"), (engine.stepper, "launch"),
                          (engine.stepper, "complete"), (engine.timing, "done")):  # fmt: skip
            delattr(obj, name)  # the class's own method again
        self.engine.timing.every = self._every

    def summary(self) -> dict:
        groups: dict[str, list[StepTimes]] = {"prompt": []}
        for s in self.steps:
            if s.prompt:
                groups["prompt"].append(s)
                continue
            top = next(b for b in DECODE_BUCKETS if s.decoding <= b)
            groups.setdefault(f"decode_le_{top}", []).append(s)
        return {name: mean_times(steps) for name, steps in groups.items() if steps}


def mean_times(steps: list[StepTimes]) -> dict:
    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    return {
        "steps": len(steps),
        "prompt_tokens": mean([s.prompt for s in steps]),
        "decoding": mean([s.decoding for s in steps]),
        "launch_ms": mean([s.launch_ms for s in steps]),
        "complete_ms": mean([s.complete_ms for s in steps]),
        "wait_ms": mean([s.wait_ms for s in steps]),
        "device_ms": mean([s.device_ms for s in steps]),
        "device_timed": sum(1 for s in steps if s.device_ms is not None),
    }
