"""KV transfer between two processes, for the disaggregation scripts: cuda_ipc on one
host's GPUs against the device-to-device copy ceiling, tcp (GPU -> pinned host ->
loopback -> GPU, or CPU to CPU in a dry run) for comparison, and nccl from GPU 0 to
GPU 1 against the peer copy rate.

A spawned receiver process owns a zeroed cache of `Layout` (llama3-8b's: 32 layers of
bf16 [blocks, 2, 16, 8, 128], 64 KiB per block and layer); this process sends from
its own random cache layer by layer from an "engine" thread, then flushes. Every case
is checked exactly: an integer checksum of each layer's transferred blocks computed in
both processes, and every other block of the receiver still zero. Rates: bytes moved
per second, and bytes read + written (2x moved, how `ceilings.copy_bandwidth` counts)
as a fraction of the copy ceiling; target >= 0.7 for cuda_ipc on one GPU.

Two timings per cuda_ipc case. Wall: first send_layer to flush() returning, as the
service sees it; back to back, with no compute to hide them, small layers are bound
by the per-layer launch cost. GPU: the engine thread first queues a sleep kernel, so
every layer's copy is queued behind it and they run back to back; CUDA events around
them time the copies alone. `fraction_of_copy` uses the GPU time. tcp and nccl are
timed on the wall only (first send_layer to the receiver's ack).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import statistics
import threading

import torch
import torch.multiprocessing as mp

from services.kv_transport.base import LayerPlan, TransferStats
from services.kv_transport.cuda_ipc import CudaIpcReceiver, CudaIpcSender
from services.kv_transport.nccl import NcclReceiver, NcclSender
from services.kv_transport.tcp import TcpReceiver, TcpSender

REPS = 5
SLEEP_CYCLES = 20_000_000  # ~10 ms at 2 GHz: longer than queueing 32 layers takes


@dataclasses.dataclass(frozen=True)
class Layout:
    layers: int = 32
    block_shape: tuple[int, ...] = (2, 16, 8, 128)
    cache_blocks: int = 4096
    # blocks per transfer: a 1k, 8k and 32k-token prompt
    sizes: tuple[tuple[str, int], ...] = (("small", 64), ("medium", 512), ("large", 2048))
    contiguous_at: tuple[int, int] = (100, 1000)  # first block of a contiguous source, dst

    def blocks(self, size: str) -> int:
        return dict(self.sizes)[size]


LLAMA3_8B = Layout()
DRY = Layout(layers=2, block_shape=(2, 16, 2, 16), cache_blocks=64,
             sizes=(("small", 4), ("medium", 8), ("large", 16)), contiguous_at=(2, 32))  # fmt: skip


def checksum(blocks: torch.Tensor) -> int:
    """Exact and order-sensitive: int64 arithmetic wraps identically in any order."""
    v = blocks.contiguous().view(torch.int16).flatten().to(torch.int64)
    w = torch.arange(v.numel(), device=v.device, dtype=torch.int64) % 65521 + 1
    return int((v * w).sum())


def _receiver(conn, device: str, layout: Layout) -> None:
    """The receiver process: one cache, a receiver per transport, driven over `conn`."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    caches = list(torch.zeros((layout.layers, layout.cache_blocks, *layout.block_shape),
                              dtype=torch.bfloat16, device=device).unbind(0))  # fmt: skip
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    receivers = {"tcp": TcpReceiver(caches, "127.0.0.1")}
    if device.startswith("cuda"):
        receivers |= {"cuda_ipc": CudaIpcReceiver(caches),
                      "nccl": NcclReceiver(caches, "127.0.0.1", timeout=120)}  # fmt: skip
    for receiver in receivers.values():
        call(receiver.start())
    conn.send({name: r.target() for name, r in receivers.items()})
    waits = {}
    while (msg := conn.recv())[0] != "stop":
        op, *args = msg
        if op == "expect":  # (transport, request id, dst ids)
            receivers[args[0]].expect(args[1], args[2], layout.layers)
            waits[args[1]] = asyncio.run_coroutine_threadsafe(
                receivers[args[0]].wait(args[1], 120), loop
            )
            conn.send(None)
        elif op == "done":  # cuda_ipc: the sender's flush returned (request id, stats)
            loop.call_soon_threadsafe(receivers["cuda_ipc"].mark_done, args[0],
                                      TransferStats(*args[1]))  # fmt: skip
            conn.send(None)
        elif op == "wait":
            stats = waits.pop(args[0]).result()
            conn.send((stats.bytes, stats.seconds))
        elif op == "check":  # per-layer checksums of the dst blocks, non-zeros elsewhere
            ids = torch.tensor(args[0], device=caches[0].device)
            outside = torch.ones(layout.cache_blocks, dtype=torch.bool, device=ids.device)
            outside[ids] = False
            sums = [checksum(c[ids]) for c in caches]
            conn.send((sums, sum(int(c[outside].count_nonzero()) for c in caches)))
        elif op == "zero":
            for c in caches:
                c.zero_()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            conn.send(None)
    for receiver in receivers.values():
        call(receiver.close())


@contextlib.contextmanager
def _receiver_on(device: str, layout: Layout):
    """A spawned receiver process on `device`; yields (pipe, an event loop for the
    senders, its targets by transport). Senders are closed by the body."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, device, layout))
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


def _plans(layout: Layout, blocks: int, gen: torch.Generator) -> dict:
    def scattered():
        return torch.randperm(layout.cache_blocks, generator=gen)[:blocks].tolist()

    src, dst = layout.contiguous_at
    contiguous = list(range(src, src + blocks))
    return {
        "contiguous->contiguous": (contiguous, list(range(dst, dst + blocks))),
        "contiguous->scattered": (contiguous, scattered()),
        "scattered->scattered": (scattered(), scattered()),
    }


def _last_copy_stream(sender: CudaIpcSender, request_id: str):
    # The stream every copy of the request ends on; the sender keeps it private, and
    # the GPU timing needs an event recorded on it.
    return sender._stream(sender._txs[request_id].remote[0].device)


def _transfer(name, sender, loop, conn, src, rid, src_ids, dst_ids, target, gpu_timing):
    layers = len(src)
    conn.send(("expect", name, rid, dst_ids))
    conn.recv()
    sender.begin(LayerPlan(rid, src_ids, dst_ids, layers), target)
    if gpu_timing:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        last_stream = _last_copy_stream(sender, rid)

    def engine():
        if gpu_timing:  # hold the copies back until every layer is queued
            torch.cuda._sleep(SLEEP_CYCLES)
            start.record()
        for layer in range(layers):
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


def _source(layout: Layout, device: str) -> list[torch.Tensor]:
    """The sending side's cache: random bf16 blocks, one tensor per layer."""
    return list(torch.randn((layout.layers, layout.cache_blocks, *layout.block_shape),
                            device=device, dtype=torch.bfloat16).unbind(0))  # fmt: skip


def run_cuda_ipc(copy_gbps: float, layout: Layout = LLAMA3_8B,
                 sizes=("small", "medium", "large")) -> list[dict]:  # fmt: skip
    """cuda_ipc from GPU 0 to a receiver on GPU 0, and on GPU 1 if there is one."""
    gen, src, rows = torch.Generator().manual_seed(0), _source(layout, "cuda:0"), []
    for device in range(min(torch.cuda.device_count(), 2)):
        with _receiver_on(f"cuda:{device}", layout) as (conn, loop, targets):
            sender = CudaIpcSender(torch.device("cuda:0"))
            for size in sizes:
                for label, (s, d) in _plans(layout, layout.blocks(size), gen).items():
                    rows.append(_case("cuda_ipc", sender, loop, conn, src, targets["cuda_ipc"],
                                      f"{size} {label} gpu0->gpu{device}", s, d,
                                      copy_gbps if device == 0 else 0.0, REPS))  # fmt: skip
            loop.run_until_complete(sender.close())
    return rows


def run_tcp(copy_gbps: float, device: str = "cuda:0", layout: Layout = LLAMA3_8B,
            sizes=("medium",)) -> list[dict]:  # fmt: skip
    """tcp from this process to a receiver process on the same device."""
    gen, src, rows = torch.Generator().manual_seed(2), _source(layout, device), []
    with _receiver_on(device, layout) as (conn, loop, targets):
        sender = TcpSender(loop)
        for size in sizes:
            s, d = _plans(layout, layout.blocks(size), gen)["contiguous->scattered"]
            rows.append(_case("tcp", sender, loop, conn, src, targets["tcp"],
                              f"{size} contiguous->scattered", s, d, copy_gbps, 2))  # fmt: skip
        loop.run_until_complete(sender.close())
    return rows


def run_nccl(peer_gbps: float, layout: Layout = LLAMA3_8B,
             sizes=("small", "medium", "large")) -> list[dict]:  # fmt: skip
    """nccl from this process on GPU 0 to a receiver process on GPU 1."""
    gen, src, rows = torch.Generator().manual_seed(1), _source(layout, "cuda:0"), []
    with _receiver_on("cuda:1", layout) as (conn, loop, targets):
        sender = NcclSender(torch.device("cuda:0"), timeout=120)
        for size in sizes:
            s, d = _plans(layout, layout.blocks(size), gen)["contiguous->scattered"]
            row = _case("nccl", sender, loop, conn, src, targets["nccl"],
                        f"{size} contiguous->scattered gpu0->gpu1", s, d, 0.0, REPS)  # fmt: skip
            row["fraction_of_peer_copy"] = row["moved_gbps"] / peer_gbps if peer_gbps else None
            rows.append(row)
        loop.run_until_complete(sender.close())
    return rows


def run(ceilings: dict, sizes=("small", "medium", "large"), tcp_sizes=("medium",)) -> dict:
    """cuda_ipc and tcp on this host's GPUs, with the llama3-8b layout."""
    copy_gbps = ceilings.get("copy_gbps") or 0.0
    layout = LLAMA3_8B
    return {
        "layout": {"layers": layout.layers, "block_shape": layout.block_shape,
                   "dtype": "bfloat16"},
        "copy_gbps": copy_gbps,
        "cuda_ipc": run_cuda_ipc(copy_gbps, layout, sizes),
        "tcp": run_tcp(copy_gbps, "cuda:0", layout, tcp_sizes),
    }  # fmt: skip
