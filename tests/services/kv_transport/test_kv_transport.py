"""KV-block transports on CPU: tcp end to end, nccl through gloo across two
processes, the transport choice, and the cuda_ipc module's CPU-testable parts."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time

import pytest
import torch

from services.kv_transport import cuda_ipc, nccl, registry, tcp
from services.kv_transport.base import LayerPlan, TransferError, TransferStats

pytestmark = pytest.mark.timeout(60)

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM = 3, 20, 4, 2, 8
SRC = [3, 7, 1, 15, 16, 9, 0]  # scattered, unordered, non-contiguous
DST = [12, 0, 5, 6, 19, 2, 11]


def make_caches(seed: int, dtype=torch.float32, dim: int = DIM) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, 2, BLOCK_SIZE, HEADS, dim)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(LAYERS)]


def assert_landed(dst, before, src, src_ids=SRC, dst_ids=DST, layers=range(LAYERS)):
    """Exactly the destination blocks of `layers` hold the source blocks; all else untouched."""
    for layer in range(LAYERS):
        for block in range(BLOCKS):
            if layer in layers and block in dst_ids:
                want = src[layer][src_ids[dst_ids.index(block)]]
            else:
                want = before[layer][block]
            assert torch.equal(dst[layer][block], want), (layer, block)


def engine_thread(sender, rid: str, caches, layers=range(LAYERS)) -> threading.Thread:
    """Sends layers from a thread of its own, as the engine does after each layer."""

    def run():
        for layer in layers:
            sender.send_layer(rid, layer, caches[layer])
            time.sleep(0.001)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@contextlib.asynccontextmanager
async def tcp_pair(dst_caches):
    """A tcp receiver writing into dst_caches and a sender, both closed at the end."""
    receiver = tcp.TcpReceiver(dst_caches, "127.0.0.1")
    await receiver.start()
    sender = tcp.TcpSender(asyncio.get_running_loop(), connect_timeout=5)
    try:
        yield receiver, sender
    finally:
        await sender.close()
        await receiver.close()


def plan(rid: str, src=SRC, dst=DST) -> LayerPlan:
    return LayerPlan(rid, list(src), list(dst), LAYERS)


def start_transfer(receiver, sender, rid: str, caches, layers=range(LAYERS), src=SRC, dst=DST):
    """The receiver expects `rid`, the sender begins it and sends `layers` of `caches`
    from a thread (returned)."""
    receiver.expect(rid, dst, LAYERS)
    sender.begin(plan(rid, src, dst), receiver.target())
    return engine_thread(sender, rid, caches, layers)


async def both_fail(receiver, sender, rid: str, match: str) -> None:
    """The sender's flush and the receiver's wait of `rid` both fail, saying `match`."""
    with pytest.raises(TransferError, match=match):
        await sender.flush(rid, 10)
    with pytest.raises(TransferError, match=match):
        await receiver.wait(rid, 10)


async def until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


# ---------------------------------------------------------------- tcp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tcp_moves_exactly_the_planned_blocks(dtype):
    src, dst = make_caches(1, dtype), make_caches(2, dtype)
    before = [t.clone() for t in dst]

    async def main():
        async with tcp_pair(dst) as (receiver, sender):
            start_transfer(receiver, sender, "r1", src)
            sent = await sender.flush("r1", timeout=10)
            got = await receiver.wait("r1", timeout=10)
        layer_bytes = len(SRC) * src[0][0].numel() * src[0].element_size()
        assert sent.bytes == got.bytes == LAYERS * layer_bytes
        assert (sent.layers, sent.blocks, got.layers, got.blocks) == (LAYERS, 7, LAYERS, 7)

    asyncio.run(main())
    assert_landed(dst, before, src)


def test_tcp_two_concurrent_requests():
    src, dst = make_caches(3), make_caches(4)
    before = [t.clone() for t in dst]
    src_b, dst_b = [4, 5, 6], [1, 3, 4]

    async def main():
        async with tcp_pair(dst) as (receiver, sender):
            start_transfer(receiver, sender, "a", src)
            start_transfer(receiver, sender, "b", src, src=src_b, dst=dst_b)
            await asyncio.gather(sender.flush("a", 10), sender.flush("b", 10))
            await asyncio.gather(receiver.wait("a", 10), receiver.wait("b", 10))

    asyncio.run(main())
    assert_landed(dst, before, src, SRC + src_b, DST + dst_b)


def test_tcp_layout_mismatch_fails_the_request_not_the_connection():
    dst = make_caches(5)
    before = [t.clone() for t in dst]
    good, bad = make_caches(6), make_caches(7, dim=DIM // 2)

    async def main():
        async with tcp_pair(dst) as (receiver, sender):
            start_transfer(receiver, sender, "bad", bad)
            await both_fail(receiver, sender, "bad", "layout")
            conn = next(iter(sender._conns.values()))
            start_transfer(receiver, sender, "good", good)
            await sender.flush("good", 10)
            await receiver.wait("good", 10)
            assert list(sender._conns.values()) == [conn]  # the same connection carried both

    asyncio.run(main())
    assert_landed(dst, before, good)


def test_tcp_corrupted_payload_is_detected(monkeypatch):
    src, dst = make_caches(8), make_caches(9)
    original = tcp.TcpSender._prepare

    def flip_a_byte(self, tx, layer, host, ready):
        head, payload = original(self, tx, layer, host, ready)
        if layer == 1:
            payload = bytearray(payload)
            payload[5] ^= 0x40
        return head, payload

    monkeypatch.setattr(tcp.TcpSender, "_prepare", flip_a_byte)

    async def main():
        async with tcp_pair(dst) as (receiver, sender):
            start_transfer(receiver, sender, "r", src)
            await both_fail(receiver, sender, "r", "checksum")

    asyncio.run(main())


def test_tcp_receiver_killed_mid_transfer_fails_fast_then_reconnects():
    src, dst, dst2 = make_caches(10), make_caches(11), make_caches(12)
    before2 = [t.clone() for t in dst2]

    async def main():
        async with tcp_pair(dst) as (receiver, sender):
            start_transfer(receiver, sender, "r", src, layers=[0]).join()
            await until(lambda: receiver._reqs["r"].layers == {0})
            await receiver.close()  # drops its connections, as a dead process would
            engine_thread(sender, "r", src, layers=[1, 2])
            begun = time.monotonic()
            with pytest.raises(TransferError):
                await sender.flush("r", timeout=5)
            assert time.monotonic() - begun < 3  # failed on the broken connection, not the timeout

            receiver2 = tcp.TcpReceiver(dst2, "127.0.0.1")
            await receiver2.start()
            start_transfer(receiver2, sender, "r2", src)
            await sender.flush("r2", 10)
            await receiver2.wait("r2", 10)
            await receiver2.close()

    asyncio.run(main())
    assert_landed(dst2, before2, src)


def test_tcp_sender_gone_fails_the_receiver_wait():
    src, dst = make_caches(13), make_caches(14)

    async def main():
        async with tcp_pair(dst) as (receiver, sender):
            start_transfer(receiver, sender, "r", src, layers=[0]).join()
            await until(lambda: receiver._reqs["r"].layers == {0})
            await sender.close()
            begun = time.monotonic()
            with pytest.raises(TransferError, match="connection lost"):
                await receiver.wait("r", 5)
            assert time.monotonic() - begun < 3

    asyncio.run(main())


def test_tcp_cancel_drops_late_frames():
    src, dst = make_caches(15), make_caches(16)
    before = [t.clone() for t in dst]

    async def main():
        async with tcp_pair(dst) as (receiver, sender):
            start_transfer(receiver, sender, "r", src, layers=[0]).join()
            await until(lambda: receiver._reqs["r"].layers == {0})
            receiver.cancel("r")
            engine_thread(sender, "r", src, layers=[1, 2])
            with pytest.raises(TransferError, match="unknown or cancelled"):
                await sender.flush("r", 5)
            with pytest.raises(TransferError):
                await receiver.wait("r", 1)

    asyncio.run(main())
    assert_landed(dst, before, src, layers=[0])  # layers 1 and 2 never landed


def test_tcp_flush_times_out_without_the_last_layer():
    src, dst = make_caches(17), make_caches(18)

    async def main():
        async with tcp_pair(dst) as (receiver, sender):
            start_transfer(receiver, sender, "r", src, layers=[0, 1])
            begun = time.monotonic()
            with pytest.raises(TransferError, match="timed out"):
                await sender.flush("r", 0.5)
            assert time.monotonic() - begun < 2

    asyncio.run(main())


# ---------------------------------------------------------------- nccl (gloo on CPU)


def _gloo_sender_process(target: bytes, requests: list, result, backlog: bool = False) -> None:
    async def main():
        sender = nccl.NcclSender(timeout=10)
        src = make_caches(21)
        if backlog:  # queued at once: the first request's early layers alone, then both
            (a, *_), (b, *_) = requests
            for rid, src_ids, dst_ids in requests:
                sender.begin(plan(rid, src_ids, dst_ids), target)
            order = [(a, n) for n in range(LAYERS // 2)]
            order += [(r, n) for n in range(LAYERS // 2, LAYERS) for r in (a, b)]
            order += [(b, n) for n in range(LAYERS // 2)]
            for rid, layer in order:
                sender.send_layer(rid, layer, src[layer])
        for rid, src_ids, dst_ids in requests:
            if not backlog:
                sender.begin(plan(rid, src_ids, dst_ids), target)
                engine_thread(sender, rid, src)
            stats = await sender.flush(rid, 20)
            result.put((rid, stats.bytes, stats.layers))
        await sender.close()

    try:
        asyncio.run(main())
    except Exception as e:  # reported, not raised: the parent asserts on it
        result.put(("error", repr(e), 0))


def _gloo_receiver_process(result, command) -> None:
    async def main():
        receiver = nccl.NcclReceiver(make_caches(22), "127.0.0.1", timeout=10)
        await receiver.start()
        receiver.expect("r1", DST, LAYERS)
        result.put(receiver.target())
        await receiver.wait("r1", 30)
        result.put("r1 landed")
        await asyncio.to_thread(command.get)  # killed while waiting here

    asyncio.run(main())


@pytest.mark.parametrize("backlog", [False, True], ids=["layer-by-layer", "backlog"])
def test_nccl_gloo_across_processes_moves_exactly_the_planned_blocks(backlog):
    """Layer by layer as an engine produces them, and a backlog of two requests'
    layers queued at once (sent in multi-layer messages, the requests interleaved)."""
    ctx = mp.get_context("spawn")
    dst = make_caches(23)
    before = [t.clone() for t in dst]
    src_b, dst_b = [10, 11, 12, 13], [7, 8, 9, 10]
    requests = [("a", SRC, DST), ("b", src_b, dst_b)]

    async def main():
        receiver = nccl.NcclReceiver(dst, "127.0.0.1", timeout=10)
        await receiver.start()
        assert json.loads(receiver.target())["backend"] == "gloo"
        receiver.expect("a", DST, LAYERS)
        receiver.expect("b", dst_b, LAYERS)
        result = ctx.Queue()
        child = ctx.Process(
            target=_gloo_sender_process, args=(receiver.target(), requests, result, backlog)
        )
        child.start()
        try:
            stats = [await receiver.wait(rid, 30) for rid, *_ in requests]
            sent = [await asyncio.to_thread(result.get, timeout=30) for _ in requests]
        finally:
            await asyncio.to_thread(child.join, 30)
            await receiver.close()
        assert [s[0] for s in sent] == ["a", "b"], sent
        assert [s[1] for s in sent] == [s.bytes for s in stats]
        assert stats[0].blocks == len(DST) and stats[0].layers == LAYERS

    asyncio.run(main())
    assert_landed(dst, before, make_caches(21), SRC + src_b, DST + dst_b)


def _gloo_sender_each(target: bytes, requests: list, result) -> None:
    """Sends each request in turn and reports each outcome, failures included."""

    async def main():
        sender = nccl.NcclSender(timeout=10)
        src = make_caches(21)
        for rid, src_ids, dst_ids in requests:
            sender.begin(plan(rid, src_ids, dst_ids), target)
            engine_thread(sender, rid, src)
            try:
                stats = await sender.flush(rid, 20)
                result.put((rid, f"ok {stats.layers}"))
            except TransferError as e:
                result.put((rid, f"error {e}"))
        await sender.close()

    asyncio.run(main())


def test_nccl_unexpected_request_fails_alone_and_the_group_keeps_serving():
    """A request the receiver does not (or no longer) expect gets one clear refusal;
    the next request on the same group lands."""
    ctx = mp.get_context("spawn")
    dst = make_caches(23)
    before = [t.clone() for t in dst]

    async def main():
        receiver = nccl.NcclReceiver(dst, "127.0.0.1", timeout=10)
        await receiver.start()
        receiver.expect("wanted", DST, LAYERS)
        result = ctx.Queue()
        requests = [("stray", SRC, DST), ("wanted", SRC, DST)]
        child = ctx.Process(target=_gloo_sender_each, args=(receiver.target(), requests, result))
        child.start()
        try:
            stats = await receiver.wait("wanted", 30)
            outcomes = dict([await asyncio.to_thread(result.get, timeout=30) for _ in requests])
        finally:
            await asyncio.to_thread(child.join, 30)
            await receiver.close()
        assert outcomes["stray"].startswith("error") and "unknown" in outcomes["stray"], outcomes
        assert outcomes["wanted"] == f"ok {LAYERS}", outcomes
        assert stats.layers == LAYERS

    asyncio.run(main())
    assert_landed(dst, before, make_caches(21))


def test_nccl_sender_fails_within_timeout_when_the_receiver_dies():
    ctx = mp.get_context("spawn")
    result, command = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_gloo_receiver_process, args=(result, command))
    child.start()
    src = make_caches(24)

    async def main():
        target = await asyncio.to_thread(result.get, timeout=30)
        sender = nccl.NcclSender(timeout=2)
        sender.begin(plan("r1"), target)
        engine_thread(sender, "r1", src)
        await sender.flush("r1", 20)  # the group works
        assert await asyncio.to_thread(result.get, timeout=10) == "r1 landed"
        os.kill(child.pid, signal.SIGKILL)
        await asyncio.to_thread(child.join, 10)
        for rid in ("r2", "r3"):  # on the broken group, then on a new group to a dead store
            start = time.monotonic()
            sender.begin(plan(rid), target)
            engine_thread(sender, rid, src)
            with pytest.raises(TransferError):
                await sender.flush(rid, 15)
            assert time.monotonic() - start < 12, rid
        await sender.close()

    try:
        asyncio.run(main())
    finally:
        if child.is_alive():
            child.kill()


# ---------------------------------------------------------------- transport choice


def endpoint(host: str, device: str, *transports: str) -> dict:
    return {"host": host, "device": device, "transports": list(transports)}


@pytest.mark.parametrize(
    ("local", "remote", "want"),
    [
        (endpoint("a", "cuda", "cuda_ipc", "nccl", "tcp"),
         endpoint("a", "cuda", "cuda_ipc", "nccl", "tcp"), "cuda_ipc"),
        (endpoint("a", "cuda", "cuda_ipc", "nccl", "tcp"),
         endpoint("b", "cuda", "cuda_ipc", "nccl", "tcp"), "nccl"),
        (endpoint("a", "cuda", "nccl", "tcp"), endpoint("a", "cuda", "nccl", "tcp"), "nccl"),
        (endpoint("a", "cuda", "cuda_ipc", "tcp"), endpoint("b", "cuda", "cuda_ipc", "tcp"), "tcp"),
        (endpoint("a", "cuda", "nccl", "tcp"), endpoint("b", "cuda", "tcp"), "tcp"),
        (endpoint("a", "cpu", "nccl", "tcp"), endpoint("a", "cuda", "cuda_ipc", "nccl"), "tcp"),
        (endpoint("a", "cpu", "tcp"), endpoint("b", "cpu", "tcp"), "tcp"),
        ({"host": "a", "device": "cuda"}, {"host": "a", "device": "cuda"}, "cuda_ipc"),
        (endpoint("a", "cuda:0", "cuda_ipc", "tcp"), endpoint("a", "cuda:1", "cuda_ipc", "tcp"),
         "cuda_ipc"),
    ],
)  # fmt: skip
def test_choose_transport(local, remote, want):
    assert registry.choose_transport(local, remote) == want
    assert registry.choose_transport(remote, local) == want


def test_registry_builds_each_transport():
    caches = make_caches(30)

    async def main():
        loop = asyncio.get_running_loop()
        assert isinstance(registry.make_receiver("tcp", caches, "127.0.0.1"), tcp.TcpReceiver)
        assert isinstance(registry.make_receiver("nccl", caches, "127.0.0.1"), nccl.NcclReceiver)
        ipc = registry.make_receiver("cuda_ipc", caches, "127.0.0.1")
        assert isinstance(ipc, cuda_ipc.CudaIpcReceiver)
        assert isinstance(registry.make_sender("tcp", "cpu", loop), tcp.TcpSender)
        assert isinstance(registry.make_sender("nccl", "cpu", loop), nccl.NcclSender)
        assert isinstance(registry.make_sender("cuda_ipc", None, loop), cuda_ipc.CudaIpcSender)
        with pytest.raises(ValueError, match="unknown"):
            registry.make_sender("rdma", None, loop)
        with pytest.raises(TransferError, match="CUDA"):
            ipc.target()  # CPU caches cannot be shared through CUDA IPC

    asyncio.run(main())


# ---------------------------------------------------------------- cuda_ipc


def test_cuda_ipc_target_loading_refuses_code():
    evil = pickle.dumps({"version": 1, "layers": [os.system]})
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        cuda_ipc.PlainUnpickler(io.BytesIO(evil)).load()
    sender = cuda_ipc.CudaIpcSender()
    with pytest.raises(TransferError, match="cannot open"):
        sender.begin(plan("r"), evil)


def test_cuda_ipc_receiver_wait_returns_once_marked_done():
    async def main():
        receiver = cuda_ipc.CudaIpcReceiver(make_caches(33))
        receiver.expect("r", DST, LAYERS)
        receiver.expect("f", DST, LAYERS)
        asyncio.get_running_loop().call_later(0.05, receiver.mark_done, "r", TransferStats(7))
        assert (await receiver.wait("r", 5)).bytes == 7
        receiver.expect("n", DST, LAYERS)
        receiver.mark_done("n")  # no stats: what the decode service reports
        assert isinstance(await receiver.wait("n", 5), TransferStats)
        receiver.mark_failed("f", "prefill flush failed")
        with pytest.raises(TransferError, match="prefill flush failed"):
            await receiver.wait("f", 5)
        receiver.expect("t", DST, LAYERS)
        with pytest.raises(TransferError, match="timed out"):
            await receiver.wait("t", 0.05)

    asyncio.run(main())


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA IPC needs a GPU; bench/gpu/pd_cuda_ipc.py runs it"
)
def test_cuda_ipc_between_processes_on_gpu():
    from bench.gpu.kv_transfer import run

    report = run({"copy_gbps": 0.0}, sizes=("small",))
    assert all(row["exact"] for row in report["cuda_ipc"])
