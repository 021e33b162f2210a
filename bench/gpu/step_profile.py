"""Where a run of engine steps spends its time. `MaskClock`: the engine thread's
parts of a step and the grammar masks' fill, timed around the engine's own methods.
`profiled`: under torch.profiler, the device's kernel time a step against the wall's
(the rest is time the device sat idle), and the host operators and CUDA calls that
took the most time of their own a step (on every thread torch runs on).
bench/gpu/structured.py compares its constrained run with the unconstrained one by
both (`profiled` with `--profile`)."""

from __future__ import annotations

import time

from torch.profiler import ProfilerActivity, profile

from bench.gpu.decode_profile import kernel_times
from engine import grammar as grammar_module
from engine import sampler as sampler_module
from engine.cuda_graphs import DecodeGraphs
from engine.model_runner import ModelRunner
from engine.sampler import DeferredSample, PendingSample, Sampler
from engine.scheduler import Scheduler
from engine.stepping import Stepper


class MaskClock:
    """The host time of each step's masks (llguidance filling the step's rows, on the
    engine's thread or the mask thread) and where the engine's thread spends a step:
    `parts` are ms per step in the stepper's launch (scheduling, queueing the step
    before's draw, the forward pass and this step's masks), in the grammars' catch-up
    (waiting for the step before's tokens, advancing past them), waiting for the device
    to have sampled a step (in the catch-up or when completing a step), waiting for masks
    still being filled, and in completing the step before (its tokens applied). Inside
    the launch: scheduling, building the step's inputs, replaying the decode graphs, the
    sampler's launch (its masks' start, the catch-up included), queueing the step
    before's draw (`DeferredSample.finish`: its masks applied, its tokens drawn)."""

    PARTS = {"launch": (Stepper, "launch"), "catch_up": (grammar_module, "catch_up"),
             "device_wait": (PendingSample, "wait"),
             "masks_wait": (grammar_module.MaskJob, "result"),
             "complete": (Stepper, "complete"), "run": (Stepper, "run"),
             "schedule": (Scheduler, "schedule"), "prepare": (ModelRunner, "prepare"),
             "graphs": (DecodeGraphs, "run"), "sampler_launch": (Sampler, "launch"),
             "masks_start": (grammar_module.MaskJob, "start"),
             "draw_finish": (DeferredSample, "finish"), "draw": (Sampler, "_finish"),
             "apply_masks": (sampler_module, "apply_masks")}  # fmt: skip

    def __init__(self):
        self.seconds, self.steps = 0.0, 0
        self.totals = dict.fromkeys(self.PARTS, 0.0)
        self._plain = {name: getattr(owner, attr) for name, (owner, attr) in self.PARTS.items()}
        self.runs = 0

    def __enter__(self) -> MaskClock:
        for name, (owner, attr) in self.PARTS.items():
            setattr(owner, attr, self._timed(name, self._plain[name]))
        return self

    def _timed(self, name: str, plain):
        clock = self

        def timed(*args, **kwargs):
            job = args[0] if name == "masks_wait" else None
            fresh = job is not None and not job.filled
            start = time.perf_counter()
            try:
                return plain(*args, **kwargs)
            finally:
                clock.totals[name] += time.perf_counter() - start
                clock.runs += name == "run"
                if fresh:
                    clock.seconds += job.fill_seconds
                    clock.steps += 1

        return timed

    def parts(self) -> dict:
        """ms per engine step (Stepper.run) of each part."""
        return {name: seconds / max(1, self.runs) * 1e3 for name, seconds in self.totals.items()}

    def __exit__(self, *exc) -> None:
        for name, (owner, attr) in self.PARTS.items():
            setattr(owner, attr, self._plain[name])


def profiled(run, steps: int, cuda: bool, top: int = 15) -> dict:
    """Runs `run()` (`steps` engine steps) under the profiler."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        run()
    wall = time.perf_counter() - start
    steps = max(1, steps)
    out = {"steps": steps, "wall_ms_per_step": wall / steps * 1e3}
    if cuda:
        kernels = kernel_times(prof, cuda=True)
        out["kernel_ms_per_step"] = sum(ms for ms, _ in kernels.values()) / steps
    host = sorted(kernel_times(prof, cuda=False).items(), key=lambda kv: -kv[1][0])
    out["host_ms_per_step"] = {name: ms / steps for name, (ms, _) in host[:top]}
    return out


def print_compared(label: str, ours: dict, other: dict, other_label: str) -> None:
    """Wall and kernel time a step of both, then the host entries of `ours` beside
    the other's time in the same entry."""
    for name, p in ((label, ours), (other_label, other)):
        kernel = p.get("kernel_ms_per_step")
        print(f"  profiled {name}: wall {p['wall_ms_per_step']:.2f} ms a step"
              + (f", kernels {kernel:.2f}" if kernel is not None else ""))  # fmt: skip
    theirs = other["host_ms_per_step"]
    for op, ms in ours["host_ms_per_step"].items():
        print(f"    {op[:60]:60} {ms:7.3f} ms a step ({other_label}: {theirs.get(op, 0.0):.3f})")
