"""The hardware ceilings every GPU experiment reports against, measured in the same
run: device-to-device copy bandwidth (bytes read + written) and the bf16
matrix-multiply rate, both on random data; between two GPUs, a torch peer copy and
NCCL point-to-point alone (two processes, one send/recv pair per message, no
headers, gathers or scatters), which the nccl KV transport is measured against.

On the CPU (a dry run) `measure` times the same copy and product at tiny sizes.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from bench.gpu.timing import median_ms

NCCL_SIZES_MB = (64, 256, 1024)
NCCL_REPS = 10


def copy_bandwidth(nbytes: int = 4 << 30, device="cuda") -> float:
    """GB/s of a large device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device)
    return 2 * nbytes / (ms / 1e3) / 1e9


def peer_copy_bandwidth(src: int = 0, dst: int = 1, nbytes: int = 1 << 30) -> float:
    """GB/s of a large copy from GPU `src` to GPU `dst` (bytes moved, one direction):
    the ceiling for KV moving between two GPUs of one host."""
    a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=f"cuda:{src}")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst}")
    with torch.cuda.device(src):
        ms = median_ms(lambda: b.copy_(a, non_blocking=True))
    return nbytes / (ms / 1e3) / 1e9


def pinned_copy_bandwidth(nbytes: int = 1 << 30, to_device: bool = True) -> float:
    """GB/s of one large copy between pinned host memory and the GPU: the ceiling
    for moving KV between the host tier and the device."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    if to_device:
        ms = median_ms(lambda: dev.copy_(host, non_blocking=True))
    else:
        ms = median_ms(lambda: host.copy_(dev, non_blocking=True))
    return nbytes / (ms / 1e3) / 1e9


def matmul_tflops(n: int = 8192, device="cuda") -> float:
    """TFLOP/s of an n x n x n bf16 matrix product on random data."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b, device)
    return 2 * n**3 / (ms / 1e3) / 1e12


def measure(device: str = "cuda") -> dict:
    """Copy and matmul ceilings of GPU 0, or of the CPU at dry-run sizes."""
    if device != "cuda":
        return {
            "device": "cpu",
            "torch": torch.__version__,
            "copy_gbps": copy_bandwidth(1 << 20, "cpu"),
            "matmul_bf16_tflops": matmul_tflops(64, "cpu"),
        }
    props = torch.cuda.get_device_properties(0)
    return {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "copy_gbps": copy_bandwidth(),
        "matmul_bf16_tflops": matmul_tflops(),
    }


def measure_with_host(device: str = "cuda") -> dict:
    """`measure`, and on CUDA the pinned host-to-device and device-to-host rates (the
    ceilings of work that moves KV between host memory and the GPU)."""
    out = measure(device)
    if device == "cuda":
        out["pinned_h2d_gbps"] = pinned_copy_bandwidth(to_device=True)
        out["pinned_d2h_gbps"] = pinned_copy_bandwidth(to_device=False)
    return out


def _nccl_rank(rank: int, port: int, result) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=60))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))  # fmt: skip
    out = {}
    for mb in NCCL_SIZES_MB:
        buf = torch.empty(mb << 20, dtype=torch.uint8, device="cuda")
        for rep in range(NCCL_REPS + 2):
            if rep == 2:
                torch.cuda.synchronize()
                dist.barrier()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
            if rank == 0:
                dist.send(buf, 1)
            else:
                dist.recv(buf, 0)
        end.record()
        end.synchronize()
        out[mb] = (mb << 20) * NCCL_REPS / (start.elapsed_time(end) / 1e3) / 1e9
    if rank == 1:
        result.put(out)
    dist.destroy_process_group()


def nccl_send_recv() -> dict[int, float]:
    """{message MB: GB/s moved GPU 0 -> GPU 1} by NCCL send/recv alone."""
    import torch.multiprocessing as mp

    from services.common.processes import free_port

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_nccl_rank, args=(r, port, result)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        return result.get(timeout=120)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def peer_ceilings() -> dict:
    """GPU 0 <-> GPU 1: torch peer copies both ways and NCCL send/recv alone."""
    return {
        "gpus": torch.cuda.device_count(),
        "peer_copy_gbps": peer_copy_bandwidth(0, 1),
        "peer_copy_gbps_1_to_0": peer_copy_bandwidth(1, 0),
        "nccl_send_recv_gbps": nccl_send_recv(),
    }
