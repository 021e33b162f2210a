"""KV blocks over plain TCP: the fallback between any two hosts, and on CPU.

One asyncio connection per (sender, receiver) pair, reused by every request.
Sender to receiver, one data frame per (request, layer):

    _HEAD (magic, kind, id length, layout length, layer, blocks, payload length, crc32)
    request id | layout "dtype:per-block-shape" | dst block ids (int32 LE) | payload

The payload is `cache_layer[src_ids]` as raw bytes. Receiver to sender: an ack
(every layer of the request is written into the cache) or an error (layout or
checksum mismatch, unknown or cancelled request), both a bare _HEAD + id +
message. Framing never depends on a frame being valid, so a bad frame fails
its request and the connection carries on.

The source blocks must stay allocated until flush() returns: on GPU the copy
out of the cache runs asynchronously after send_layer() has returned.

The receiving bookkeeping is `blocks.BlockReceiver`, shared with nccl.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import struct
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from services.kv_transport.base import KvSender, LayerPlan, TransferError, TransferStats
from services.kv_transport.blocks import (
    BlockReceiver,
    Incoming,
    abort_transfer,
    await_future,
    find_transfer,
    ids_bytes,
    layout,
    settle,
)

MAGIC = b"YKV1"
DATA, ACK, ERROR = 1, 2, 3
_HEAD = struct.Struct("!4sBHHIIQI")
MAX_PAYLOAD = 1 << 36  # a bigger length means the stream is garbage: drop the connection


def frame(kind: int, rid: str, text: str = "", layer=0, blocks=0, length=0, crc=0) -> bytes:
    r, t = rid.encode(), text.encode()
    return _HEAD.pack(MAGIC, kind, len(r), len(t), layer, blocks, length, crc) + r + t


async def read_frame(reader: asyncio.StreamReader) -> tuple:
    magic, kind, rlen, tlen, layer, blocks, length, crc = _HEAD.unpack(
        await reader.readexactly(_HEAD.size)
    )
    if magic != MAGIC or length > MAX_PAYLOAD:
        raise ConnectionError("not a KV frame: stream out of sync")
    rid = (await reader.readexactly(rlen)).decode()
    text = (await reader.readexactly(tlen)).decode()
    return kind, rid, text, layer, blocks, length, crc


async def _read_into(reader: asyncio.StreamReader, n: int) -> bytearray:
    # A writable buffer (readexactly gives read-only bytes, which torch.frombuffer warns about).
    buf, got = bytearray(n), 0
    view = memoryview(buf)
    while got < n:
        chunk = await reader.read(min(n - got, 1 << 22))
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(view[:got]), n)
        view[got : got + len(chunk)] = chunk
        got += len(chunk)
    return buf


class TcpReceiver(BlockReceiver):
    name = "tcp"

    def __init__(self, kv_caches: list[torch.Tensor], host: str, port: int = 0):
        super().__init__(kv_caches)
        self.host, self.port = host, port
        self._conns: set[asyncio.StreamWriter] = set()
        # One writer thread: checksums, copies and the GPU sync stay off the event loop.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-tcp-recv")
        self._stream = None
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    def target(self) -> bytes:
        return json.dumps({"host": self.host, "port": self.port}).encode()

    async def close(self) -> None:
        if self._server:
            self._server.close()
        for writer in list(self._conns):
            writer.transport.abort()
        for rid in list(self._reqs):
            self.cancel(rid)
        self._pool.shutdown(wait=False)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        loop = asyncio.get_running_loop()
        try:
            while True:
                kind, rid, text, layer, blocks, length, crc = await read_frame(reader)
                if kind != DATA:
                    raise ConnectionError(f"unexpected frame kind {kind}")
                ids = await reader.readexactly(4 * blocks)
                payload = await _read_into(reader, length)
                rx, refuse = self._active(rid, writer)
                if refuse:
                    writer.write(frame(ERROR, rid, "unknown or cancelled request"))
                if rx is None:
                    continue
                error = await loop.run_in_executor(
                    self._pool, self._take, rx, layer, text, ids, payload, crc
                )
                if error:
                    self._fail(rid, rx, error)
                    writer.write(frame(ERROR, rid, error))
                elif self._landed(rx, layer, length):
                    writer.write(frame(ACK, rid))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            self._lost(writer, f"connection lost: {e!r}")
        finally:
            self._conns.discard(writer)
            writer.transport.abort()

    def _take(self, rx: Incoming, layer, text, ids, payload: bytearray, crc) -> str | None:
        """Checks one frame and writes it into the cache (writer thread); None if done."""
        if zlib.crc32(payload) != crc:
            return f"layer {layer}: payload checksum mismatch"
        error = self._check(rx, layer, text, ids, len(payload))
        if error or not payload:
            return error
        if self.device.type == "cuda":
            self._stream = self._stream or torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._stream):
                self._write(rx, layer, torch.frombuffer(payload, dtype=torch.uint8))
        else:
            self._write(rx, layer, torch.frombuffer(payload, dtype=torch.uint8))
        return None


@dataclass(eq=False)
class _Outgoing:
    plan: LayerPlan
    dst_ids: bytes
    done: cf.Future = field(default_factory=cf.Future)
    conn: _Conn | None = None
    index: dict = field(default_factory=dict)  # device -> source ids there
    nbytes: int = 0
    t0: float = 0.0


@dataclass(eq=False)
class _Conn:
    key: tuple[str, int]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    txs: dict = field(default_factory=dict)  # request id -> _Outgoing awaiting its ack
    tasks: list = field(default_factory=list)
    writer: asyncio.StreamWriter | None = None
    closed: bool = False
    busy: bool = False  # a frame is being prepared or written
    progress: float = field(default_factory=time.monotonic)  # last write done or reply read


class TcpSender(KvSender):
    """`begin` and `send_layer` may run on any thread; `flush` runs on `loop`."""

    name = "tcp"

    def __init__(self, loop: asyncio.AbstractEventLoop, connect_timeout: float = 10.0):
        self._loop, self.connect_timeout = loop, connect_timeout
        self._txs: dict[str, _Outgoing] = {}
        self._conns: dict[tuple[str, int], _Conn] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        # GPU syncs and checksums of big payloads would stall the event loop.
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kv-tcp-send")

    def begin(self, plan: LayerPlan, target: bytes) -> None:
        addr = json.loads(target)
        tx = _Outgoing(plan, ids_bytes(plan.dst_block_ids))
        self._txs[plan.request_id] = tx
        # Connections live on the loop; callbacks run in order, so this one precedes
        # any layer that send_layer() hands over after begin() returned.
        self._loop.call_soon_threadsafe(self._attach, tx, (addr["host"], int(addr["port"])))

    def send_layer(self, request_id: str, layer: int, cache_layer: torch.Tensor) -> None:
        tx = self._txs.get(request_id)
        if tx is None or tx.done.done():
            return  # aborted, timed out or failed: late layers go nowhere
        tx.t0 = tx.t0 or time.perf_counter()
        dev = cache_layer.device
        if dev not in tx.index:
            tx.index[dev] = torch.tensor(tx.plan.src_block_ids, dtype=torch.long, device=dev)
        ready = None
        if cache_layer.is_cuda:
            # Gather and copy to pinned memory on a side stream once the layer's
            # compute is done; the engine thread only enqueues GPU work.
            if dev not in self._streams:
                self._streams[dev] = torch.cuda.Stream(dev)
            stream = self._streams[dev]
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                blocks = cache_layer.index_select(0, tx.index[dev])
                host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
                host.copy_(blocks, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(stream)
        else:
            host = cache_layer.index_select(0, tx.index[dev])  # the contiguous copy
        self._loop.call_soon_threadsafe(self._enqueue, tx, layer, host, ready)

    async def flush(self, request_id: str, timeout: float) -> TransferStats:
        tx = find_transfer(self._txs, request_id, "no transfer begun")
        try:
            return await await_future(tx.done, timeout, request_id)
        except TransferError:
            conn = tx.conn
            stalled = conn and (conn.busy or not conn.queue.empty())
            if stalled and time.monotonic() - conn.progress >= timeout:
                self._break(conn, TimeoutError(f"no progress for {timeout:.1f} s"))
            raise
        finally:
            self._txs.pop(request_id, None)
            if tx.conn:
                tx.conn.txs.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        abort_transfer(self._txs, request_id)

    async def close(self) -> None:
        for conn in list(self._conns.values()):
            self._break(conn, ConnectionError("sender closed"))
        self._pool.shutdown(wait=False)

    def _attach(self, tx: _Outgoing, key: tuple[str, int]) -> None:
        if tx.done.done():
            return
        conn = self._conns.get(key)
        if conn is None or conn.closed:  # first use, or the last connection broke
            conn = self._conns[key] = _Conn(key)
            conn.tasks.append(self._loop.create_task(self._pump(conn)))
        tx.conn = conn
        conn.txs[tx.plan.request_id] = tx

    def _enqueue(self, tx: _Outgoing, layer: int, host: torch.Tensor, ready) -> None:
        if tx.conn is not None and not tx.done.done():
            tx.conn.queue.put_nowait((tx, layer, host, ready))

    def _prepare(self, tx: _Outgoing, layer: int, host: torch.Tensor, ready) -> tuple:
        """Header and payload of one frame (worker thread: waits for the GPU copy)."""
        if ready is not None:
            ready.synchronize()
        payload = memoryview(host.reshape(-1).view(torch.uint8).numpy())
        head = frame(
            DATA, tx.plan.request_id, layout(host), layer, host.shape[0], len(payload),
            zlib.crc32(payload),
        )  # fmt: skip
        return head + tx.dst_ids, payload

    async def _pump(self, conn: _Conn) -> None:
        """Connects, then writes this connection's frames in the order they were queued."""
        try:
            connect = asyncio.open_connection(*conn.key)
            reader, conn.writer = await asyncio.wait_for(connect, self.connect_timeout)
            conn.tasks.append(self._loop.create_task(self._read_replies(conn, reader)))
            while True:
                tx, layer, host, ready = await conn.queue.get()
                if tx.done.done():
                    continue
                conn.busy = True
                head, payload = await self._loop.run_in_executor(
                    self._pool, self._prepare, tx, layer, host, ready
                )
                conn.writer.write(head)
                conn.writer.write(payload)
                tx.nbytes += len(payload)
                await conn.writer.drain()
                conn.busy, conn.progress = False, time.monotonic()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # refused, reset, timed out: every request on it fails
            self._break(conn, e)

    async def _read_replies(self, conn: _Conn, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                kind, rid, text, *_ = await read_frame(reader)
                conn.progress = time.monotonic()
                tx = conn.txs.pop(rid, None)
                if tx is None:
                    continue
                if kind == ACK:
                    seconds = time.perf_counter() - tx.t0
                    blocks = len(tx.plan.dst_block_ids)
                    settle(tx.done, TransferStats(tx.nbytes, seconds, tx.plan.num_layers, blocks))
                else:
                    settle(tx.done, error=TransferError(f"{rid}: receiver: {text}"))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._break(conn, e)

    def _break(self, conn: _Conn, err: BaseException) -> None:
        if conn.closed:
            return
        conn.closed = True
        if self._conns.get(conn.key) is conn:
            del self._conns[conn.key]  # the next begin() reconnects
        for rid, tx in conn.txs.items():
            settle(tx.done, error=TransferError(f"{rid}: connection to {conn.key}: {err!r}"))
        conn.txs.clear()
        current = asyncio.current_task()
        for task in conn.tasks:
            if task is not current:
                task.cancel()
        if conn.writer is not None:
            conn.writer.transport.abort()
