"""How the GPU scripts time a call, on the GPU or (in a dry run) on the CPU.

* `median_ms`: CUDA events around each call, or the host clock on the CPU.
* `flushed_ms`: per call with the L2 cache flushed first (`triton.testing.do_bench`).
* `graph_ms`: replays of a CUDA graph of the call (`do_bench_cudagraph`), as the engine
  runs decode; None on the CPU.
* `queued_ms`: back-to-back calls queued while the GPU is held busy
  (`kernels.selection.cuda_timer`), so the host's launch cost stays out, as inside a
  graph; the kernel tuner times most candidates the same way.
* `cold_ms`: each call alone with the L2 cache overwritten first, queued while the GPU is
  held busy (`kernels.selection.cold_cuda_timer`): how the tuner times the decode
  projections, whose weights a step reads once.

On the CPU every timer is `median_ms` with few repetitions: a dry run checks that
the code runs, not how fast.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def _cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def median_ms(fn: Callable[[], object], device="cuda", iters: int = 20, warmup: int = 3) -> float:
    cuda = _cuda(device)
    if not cuda:
        iters, warmup = min(iters, 3), min(warmup, 1)
    for _ in range(warmup):
        fn()
    times = []
    if cuda:
        torch.cuda.synchronize()
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    times.sort()
    return times[len(times) // 2]


def flushed_ms(fn: Callable[[], object], device="cuda") -> float:
    if not _cuda(device):
        return median_ms(fn, device)
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=100, return_mode="median")


def graph_ms(fn: Callable[[], object], device="cuda") -> float | None:
    if not _cuda(device):
        return None
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=50, return_mode="median")


def queued_ms(fn: Callable[[], object], device="cuda", sample_ms: float = 3.0,
              rounds: int = 9) -> float:  # fmt: skip
    """GPU milliseconds of one call: the median over `rounds` samples, each about
    `sample_ms` of back-to-back calls queued while the GPU is held busy."""
    if not _cuda(device):
        return median_ms(fn, device)
    from kernels.selection import cuda_timer

    return cuda_timer(fn, warmup=1, reps=rounds, sample_ms=sample_ms)


def cold_ms(fn: Callable[[], object], device="cuda", rounds: int = 15) -> float:
    """GPU milliseconds of one call with its inputs out of the L2 cache: the median of
    `rounds` calls, each after the cache is overwritten."""
    if not _cuda(device):
        return median_ms(fn, device)
    from kernels.selection import cold_cuda_timer

    return cold_cuda_timer(fn, warmup=1, reps=rounds)
