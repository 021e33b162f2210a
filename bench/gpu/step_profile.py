"""Where a run of engine steps spends its time, under torch.profiler: the device's
kernel time a step against the wall's (the rest is time the device sat idle), and
the host operators and CUDA calls that took the most time of their own a step (on
every thread torch runs on). bench/gpu/structured.py compares its constrained run
with the unconstrained one by it (`--profile`)."""

from __future__ import annotations

import time

from torch.profiler import ProfilerActivity, profile

from bench.gpu.decode_profile import kernel_times


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
