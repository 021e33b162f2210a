"""What NCCL point-to-point itself moves between GPU 0 and GPU 1: two processes,
one send/recv pair per message back to back, no headers, gathers or scatters.
The nccl KV transport is measured against this and the torch peer copy.

Usage: python -m bench.nccl_ceiling  (prints GB/s per message size)
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES_MB = (64, 256, 1024)
REPS = 10


def _rank(rank: int, port: int, result) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=60))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))  # fmt: skip
    out = {}
    for mb in SIZES_MB:
        buf = torch.empty(mb << 20, dtype=torch.uint8, device="cuda")
        for rep in range(REPS + 2):
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
        out[mb] = (mb << 20) * REPS / (start.elapsed_time(end) / 1e3) / 1e9
    if rank == 1:
        result.put(out)
    dist.destroy_process_group()


def measure() -> dict[int, float]:
    """{message MB: GB/s moved GPU 0 -> GPU 1}."""
    from services.common.processes import free_port

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, result)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        return result.get(timeout=120)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


if __name__ == "__main__":
    for mb, gbps in measure().items():
        print(f"NCCL send/recv {mb} MB: {gbps:.0f} GB/s")
