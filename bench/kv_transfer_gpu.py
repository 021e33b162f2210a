"""KV transfer between two processes on one host's GPUs: cuda_ipc against the
device-to-device copy ceiling, tcp (GPU -> pinned host -> loopback -> GPU) for
comparison, and nccl from GPU 0 to GPU 1 against the peer copy rate.

A spawned receiver process owns a zeroed bf16 cache of a llama3-8b layout (32
layers of [blocks, 2, 16, 8, 128]: 64 KiB per block and layer); this process
sends from its own random cache layer by layer from an "engine" thread, then
flushes. Every case is checked exactly: an integer checksum of each layer's
transferred blocks computed in both processes, and every other block of the
receiver still zero. Rates: bytes moved per second, and bytes read + written
(2x moved, how `bench.ceilings.copy_bandwidth` counts) as a fraction of
`ceilings["copy_gbps"]`; target >= 0.7 for cuda_ipc on one GPU.

Two timings per case. Wall: first send_layer to flush() returning, as the
service sees it; back to back, with no compute to hide them, small layers are
bound by the per-layer launch cost (about 3 torch/Triton launches). GPU: the
engine thread first queues a sleep kernel, so every layer's copy is queued
behind it and they run back to back; CUDA events around them time the copies
alone. `fraction_of_copy` uses the GPU time. nccl is timed on the wall only
(first send_layer to the receiver's ack); `run_nccl` reports bytes moved per
second as a fraction of `peer_gbps`, a torch copy GPU 0 -> GPU 1.

Usage: python -m bench.kv_transfer_gpu [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import threading
from pathlib import Path

import torch
import torch.multiprocessing as mp

from services.common.kv_transport.base import LayerPlan, TransferStats
from services.common.kv_transport.cuda_ipc import CudaIpcReceiver, CudaIpcSender
from services.common.kv_transport.nccl import NcclReceiver, NcclSender
from services.common.kv_transport.tcp import TcpReceiver, TcpSender

LAYERS, BLOCK_SHAPE, CACHE_BLOCKS = 32, (2, 16, 8, 128), 4096
SIZES = {"small": 64, "medium": 512, "large": 2048}  # blocks: 1k, 8k, 32k-token prompts
REPS = 5
SLEEP_CYCLES = 20_000_000  # ~10 ms at 2 GHz: longer than queueing 32 layers takes


def checksum(blocks: torch.Tensor) -> int:
    """Exact and order-sensitive: int64 arithmetic wraps identically in any order."""
    v = blocks.contiguous().view(torch.int16).flatten().to(torch.int64)
    w = torch.arange(v.numel(), device=v.device, dtype=torch.int64) % 65521 + 1
    return int((v * w).sum())


def _receiver(conn, device: int) -> None:
    """The receiver process: one cache, a cuda_ipc and a tcp receiver, driven over `conn`."""
    torch.cuda.set_device(device)
    caches = list(torch.zeros((LAYERS, CACHE_BLOCKS, *BLOCK_SHAPE), dtype=torch.bfloat16,
                              device=f"cuda:{device}").unbind(0))  # fmt: skip
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    ipc, tcp = CudaIpcReceiver(caches), TcpReceiver(caches, "127.0.0.1")
    nccl = NcclReceiver(caches, "127.0.0.1", timeout=120)
    call(tcp.start())
    call(nccl.start())
    conn.send((ipc.target(), tcp.target(), nccl.target()))
    waits = {}
    while (msg := conn.recv())[0] != "stop":
        op, *args = msg
        if op == "expect":  # (transport, request id, dst ids)
            receiver = {"cuda_ipc": ipc, "tcp": tcp, "nccl": nccl}[args[0]]
            receiver.expect(args[1], args[2], LAYERS)
            waits[args[1]] = asyncio.run_coroutine_threadsafe(receiver.wait(args[1], 120), loop)
            conn.send(None)
        elif op == "done":  # cuda_ipc: the sender's flush returned (request id, stats)
            loop.call_soon_threadsafe(ipc.mark_done, args[0], TransferStats(*args[1]))
            conn.send(None)
        elif op == "wait":
            stats = waits.pop(args[0]).result()
            conn.send((stats.bytes, stats.seconds))
        elif op == "check":  # per-layer checksums of the dst blocks, non-zeros elsewhere
            ids = torch.tensor(args[0], device=caches[0].device)
            outside = torch.ones(CACHE_BLOCKS, dtype=torch.bool, device=ids.device)
            outside[ids] = False
            sums = [checksum(c[ids]) for c in caches]
            conn.send((sums, sum(int(c[outside].count_nonzero()) for c in caches)))
        elif op == "zero":
            for c in caches:
                c.zero_()
            torch.cuda.synchronize()
            conn.send(None)
    call(tcp.close())
    call(nccl.close())


def _plans(blocks: int, gen: torch.Generator) -> dict[str, tuple[list[int], list[int]]]:
    def scattered():
        return torch.randperm(CACHE_BLOCKS, generator=gen)[:blocks].tolist()

    contiguous = list(range(100, 100 + blocks))
    return {
        "contiguous->contiguous": (contiguous, list(range(1000, 1000 + blocks))),
        "contiguous->scattered": (contiguous, scattered()),
        "scattered->scattered": (scattered(), scattered()),
    }


def _transfer(name, sender, loop, conn, src, rid, src_ids, dst_ids, target, gpu_timing):
    conn.send(("expect", name, rid, dst_ids))
    conn.recv()
    sender.begin(LayerPlan(rid, src_ids, dst_ids, LAYERS), target)
    if gpu_timing:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        last_stream = sender._stream(sender._txs[rid].remote[0].device)  # ends every copy

    def engine():
        if gpu_timing:  # hold the copies back until every layer is queued
            torch.cuda._sleep(SLEEP_CYCLES)
            start.record()
        for layer in range(LAYERS):
            sender.send_layer(rid, layer, src[layer])
        if gpu_timing:
            end.record(last_stream)

    thread = threading.Thread(target=engine)
    thread.start()
    stats = loop.run_until_complete(sender.flush(rid, 120))
    thread.join()
    if name == "cuda_ipc":  # the decode side learns of completion from the prefill side
        conn.send(("done", rid, (stats.bytes, stats.seconds, stats.layers, stats.blocks)))
        conn.recv()
    conn.send(("wait", rid))
    conn.recv()
    return stats, start.elapsed_time(end) / 1e3 if gpu_timing else None


def _case(name, sender, loop, conn, src, target, label, src_ids, dst_ids, copy_gbps, reps):
    conn.send(("zero",))
    conn.recv()
    wall, gpu = [], []
    for rep in range(2 * reps + 1 if name == "cuda_ipc" else reps + 1):
        timed = name == "cuda_ipc" and rep > reps  # the first run warms up and opens handles
        stats, gpu_s = _transfer(name, sender, loop, conn, src, f"{label}-{rep}", src_ids,
                                 dst_ids, target, timed)  # fmt: skip
        (gpu if timed else wall).append(gpu_s if timed else stats.seconds)
    conn.send(("check", dst_ids))
    sums, nonzero_outside = conn.recv()
    index = torch.tensor(src_ids, device=src[0].device)
    exact = sums == [checksum(layer[index]) for layer in src] and nonzero_outside == 0
    moved, wall_s = stats.bytes, statistics.median(wall[1:])
    row = {"transport": name, "plan": label, "blocks": len(src_ids), "bytes_moved": moved,
           "ms": wall_s * 1e3, "moved_gbps": moved / wall_s / 1e9,
           "rw_gbps": 2 * moved / wall_s / 1e9, "exact": exact}  # fmt: skip
    rw = row["rw_gbps"]
    if gpu:
        gpu_s = statistics.median(gpu)
        row |= {"gpu_ms": gpu_s * 1e3, "gpu_rw_gbps": 2 * moved / gpu_s / 1e9}
        rw = row["gpu_rw_gbps"]
    row["fraction_of_copy"] = rw / copy_gbps if copy_gbps else None
    print(json.dumps(row), flush=True)
    return row


def _source() -> list[torch.Tensor]:
    """The sending side's cache on GPU 0: random bf16 blocks, one tensor per layer."""
    return list(torch.randn((LAYERS, CACHE_BLOCKS, *BLOCK_SHAPE), device="cuda:0",
                            dtype=torch.bfloat16).unbind(0))  # fmt: skip


@contextlib.contextmanager
def _receiver_on(device: int):
    """A spawned receiver process on GPU `device`; yields (pipe, an event loop for
    the senders, its (cuda_ipc, tcp, nccl) targets). Senders are closed by the body."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, device))
    proc.start()
    loop = asyncio.new_event_loop()
    try:
        yield parent, loop, parent.recv()
        parent.send(("stop",))
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
        loop.close()


def run(ceilings: dict, sizes=("small", "medium", "large"), tcp_sizes=("medium",)) -> dict:
    copy_gbps = ceilings.get("copy_gbps") or 0.0
    gen = torch.Generator().manual_seed(0)
    src = _source()
    report = {"layout": {"layers": LAYERS, "block_shape": BLOCK_SHAPE, "dtype": "bfloat16"},
              "copy_gbps": copy_gbps, "cuda_ipc": [], "tcp": []}  # fmt: skip
    for device in range(min(torch.cuda.device_count(), 2)):  # same GPU; another GPU if any
        with _receiver_on(device) as (parent, loop, (ipc_target, tcp_target, _)):
            ipc, tcp = CudaIpcSender(torch.device("cuda:0")), TcpSender(loop)
            for size in sizes:
                for label, (s, d) in _plans(SIZES[size], gen).items():
                    tag = f"{size} {label} gpu0->gpu{device}"
                    row = _case("cuda_ipc", ipc, loop, parent, src, ipc_target, tag, s, d,
                                copy_gbps if device == 0 else 0.0, REPS)  # fmt: skip
                    report["cuda_ipc"].append(row)
            for size in tcp_sizes if device == 0 else ():
                s, d = _plans(SIZES[size], gen)["contiguous->scattered"]
                tag = f"{size} contiguous->scattered"
                row = _case("tcp", tcp, loop, parent, src, tcp_target, tag, s, d, copy_gbps, 2)
                report["tcp"].append(row)
            loop.run_until_complete(tcp.close())
            loop.run_until_complete(ipc.close())
    return report


def run_nccl(peer_gbps: float, sizes=("small", "medium", "large")) -> list[dict]:
    """nccl from this process on GPU 0 to a receiver process on GPU 1."""
    gen = torch.Generator().manual_seed(1)
    src, rows = _source(), []
    with _receiver_on(1) as (parent, loop, (*_, target)):
        sender = NcclSender(torch.device("cuda:0"), timeout=120)
        for size in sizes:
            s, d = _plans(SIZES[size], gen)["contiguous->scattered"]
            row = _case("nccl", sender, loop, parent, src, target,
                        f"{size} contiguous->scattered gpu0->gpu1", s, d, 0.0, REPS)  # fmt: skip
            row["fraction_of_peer_copy"] = row["moved_gbps"] / peer_gbps if peer_gbps else None
            rows.append(row)
        loop.run_until_complete(sender.close())
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from bench.ceilings import copy_bandwidth

    ceilings = {"copy_gbps": copy_bandwidth(), "device": torch.cuda.get_device_name(0),
                "torch": torch.__version__}  # fmt: skip
    report = run(ceilings) | {"ceilings": ceilings}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    print(f"copy ceiling {ceilings['copy_gbps']:.0f} GB/s (read + written)")
    print("| transport | case | MB | wall ms | wall r+w GB/s | GPU ms | GPU r+w GB/s "
          "| of copy | exact |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for row in report["cuda_ipc"] + report["tcp"]:
        frac = f"{row['fraction_of_copy']:.2f}" if row["fraction_of_copy"] else "-"
        print(f"| {row['transport']} | {row['plan']} | {row['bytes_moved'] / 2**20:.0f} | "
              f"{row['ms']:.2f} | {row['rw_gbps']:.0f} | {row.get('gpu_ms', 0):.3f} | "
              f"{row.get('gpu_rw_gbps', 0):.0f} | {frac} | {row['exact']} |")  # fmt: skip


if __name__ == "__main__":
    main()
