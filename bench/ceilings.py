"""The two hardware ceilings every GPU benchmark reports against, measured in
the same run: device-to-device copy bandwidth (bytes read + written) and the
bf16 matrix-multiply rate, both on random data."""

from __future__ import annotations

import torch


def _median_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """GB/s of a large device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms / 1e3) / 1e9


def peer_copy_bandwidth(src: int = 0, dst: int = 1, nbytes: int = 1 << 30) -> float:
    """GB/s of a large copy from GPU `src` to GPU `dst` (bytes moved, one direction):
    the ceiling for KV moving between two GPUs of one host."""
    a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=f"cuda:{src}")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst}")
    with torch.cuda.device(src):
        ms = _median_ms(lambda: b.copy_(a, non_blocking=True))
    return nbytes / (ms / 1e3) / 1e9


def matmul_tflops(n: int = 8192) -> float:
    """TFLOP/s of an n x n x n bf16 matrix product on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = _median_ms(lambda: a @ b)
    return 2 * n**3 / (ms / 1e3) / 1e12


def measure() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "copy_gbps": copy_bandwidth(),
        "matmul_bf16_tflops": matmul_tflops(),
    }
