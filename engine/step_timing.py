"""Where an engine's steps spend their time, for metrics and benchmarks: how many
steps ran, how long the engine thread waited for the device to finish them
(reading their sampled tokens back), and on CUDA the device's own time for one
step in every `every` that samples (events recorded on the stream around its
launch, read once its tokens are back, so nothing waits for them; a step that
samples nothing, a long prompt's chunk, is counted but not timed: reading its
events would wait for it).

A step's device time runs from when the stream reaches its first kernel to
its last one: gaps in it are the device waiting for the host to queue more.
Two meshes whose steps take the same device time but serve at different
speeds differ on the host; the same host time and different device times
point at the device (copies or kernels running beside the steps)."""

from __future__ import annotations

import torch


class StepTiming:
    def __init__(self, cuda: bool, every: int = 8):
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        self.cuda, self.every = cuda, every
        self.steps = 0
        self.wait_seconds = 0.0
        self.device_seconds = 0.0
        self.device_steps = 0
        self._launched = 0

    def begin(self):
        """Before a step's launch: its start event, for one step in `every` on CUDA."""
        self._launched += 1
        if not self.cuda or self._launched % self.every:
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def end(self, start):
        """After the launch: what `done` reads (None for a step not timed)."""
        if start is None:
            return None
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return start, end

    def done(self, timing, waited: float) -> None:
        """Once a step's tokens were read back (its events are complete then);
        `waited`: seconds the thread waited for them."""
        self.steps += 1
        self.wait_seconds += waited
        if timing is not None:
            start, end = timing
            end.synchronize()  # recorded just after the step's read-back: done at once
            self.device_seconds += start.elapsed_time(end) / 1e3
            self.device_steps += 1

    def stats(self) -> dict:
        return {
            "num_steps": self.steps,
            "step_wait_seconds": self.wait_seconds,
            "step_device_seconds": self.device_seconds,
            "steps_device_timed": self.device_steps,
        }
