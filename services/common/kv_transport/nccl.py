"""KV blocks over torch.distributed point-to-point: NCCL for CUDA caches, gloo
for CPU caches, with the same logic.

Rendezvous: the receiver hosts a TCPStore (`target()` = {"host", "port",
"backend"}). A sender joins with a fresh group id (`n = add("joins", 1) - 1`,
`set("join/<n>", gid)`); the receiver's acceptor thread takes joins in order,
and both sides build a 2-rank backend (rank 0 receiver, rank 1 sender) straight
on `PrefixStore("g/<gid>/pg")` -- backend objects, not the global default
group, so any number of pairs coexist in one process.

Data and control: each layer's blocks go as one contiguous uint8 tensor through
the group's send/recv. A header key "g/<gid>/h/<seq>" in the store (request,
layer, block count and ids, bytes, layout) announces every data message, and
the receiver's per-group thread blocks on it, so a recv is only posted when its
data is on the way: an idle posted NCCL recv would hold SMs and trip the
watchdog, and a gloo recv that times out closes the pair. After a request's
last layer is in the cache the receiver writes "g/<gid>/ack/<request>" ("ok" or
why not); the sender's ack thread turns it into the result of flush(). The
receiving thread is per group rather than started by expect(): the receiver
cannot know which sender (group) a request will arrive on, and the headers
carry the request id, so expect() only registers the destination blocks.

Failures: sends and recvs have timeouts; a failed one ends the group and fails
its in-flight requests with TransferError, and the sender's next begin() for
that target forms a new group. Store waits block without a timeout (timed-out
waits log at C++ level) and are woken by writing the awaited key.
The source blocks must stay allocated until flush() returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import json
import os
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from services.common.kv_transport.base import KvSender, LayerPlan, TransferError, TransferStats
from services.common.kv_transport.tcp import BlockReceiver, await_future, layout, settle

FOREVER = timedelta(days=365)


def make_group(backend: str, store, rank: int, timeout: float, host: str):
    """A 2-rank backend object on `store`, outside the default process group."""
    td = timedelta(seconds=timeout)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = td
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = td
    # The default (3) kills the process when an op times out; 2 only aborts the
    # communicator, so our wait() raises instead. Read at construction only.
    var, old = "TORCH_NCCL_ASYNC_ERROR_HANDLING", os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    os.environ[var] = "2"
    try:
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    finally:
        os.environ.pop(var) if old is None else os.environ.__setitem__(var, old)


def _start(threads: list, target, *args) -> None:
    thread = threading.Thread(target=target, args=args, daemon=True)
    threads[:] = [t for t in threads if t.is_alive()] + [thread]
    thread.start()


def _join(threads: list, timeout: float) -> None:
    # Threads still inside c10d calls when the interpreter exits abort the process.
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


def _abort(pg) -> None:
    for name in ("abort", "shutdown"):
        with contextlib.suppress(Exception):
            getattr(pg, name)()
            return


def _client(host: str, port: int, timeout: float) -> dist.TCPStore:
    # One connection per blocking user: a TCPStore client runs one op at a time.
    return dist.TCPStore(
        host, port, None, False, timedelta(seconds=timeout), wait_for_workers=False
    )


def _local_address(host: str, port: int) -> str:
    """The address this host reaches `host` from (gloo binds to it); "" = gloo's default."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # sends nothing
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return ""


class NcclReceiver(BlockReceiver):
    name = "nccl"

    def __init__(self, kv_caches: list[torch.Tensor], host: str, port: int = 0, timeout=30.0):
        super().__init__(kv_caches)
        self.host, self.port, self.timeout = host, port, timeout
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self._groups: dict[str, list] = {}  # gid -> [next header seq, backend]
        self._stop = threading.Event()
        self._joins = 0
        self._threads: list[threading.Thread] = []
        self._store = None

    async def start(self) -> None:
        self._store = dist.TCPStore(
            self.host, self.port, None, True, timedelta(seconds=self.timeout),
            wait_for_workers=False,
        )  # fmt: skip
        self.port = self._store.port
        _start(self._threads, self._accept)

    def target(self) -> bytes:
        return json.dumps({"host": self.host, "port": self.port, "backend": self.backend}).encode()

    async def close(self) -> None:
        self._stop.set()
        if self._store is None:
            return
        with contextlib.suppress(Exception):  # wake the acceptor and every group thread
            self._store.set(f"join/{self._joins}", "")
            for gid, (seq, pg) in list(self._groups.items()):
                self._store.set(f"g/{gid}/h/{seq}", "{}")
                _abort(pg)
        for rid in list(self._reqs):
            self.cancel(rid)
        await asyncio.to_thread(_join, self._threads, self.timeout)

    def _accept(self) -> None:
        with contextlib.suppress(Exception):  # the store goes away with close()
            store = _client(self.host, self.port, self.timeout)
            while not self._stop.is_set():
                key = f"join/{self._joins}"
                store.wait([key], FOREVER)
                gid = store.get(key).decode()
                store.delete_key(key)
                self._joins += 1
                if gid and not self._stop.is_set():
                    _start(self._threads, self._serve, gid)

    def _serve(self, gid: str) -> None:
        """Receives one group's messages in order until its sender leaves or fails."""
        store = dist.PrefixStore(f"g/{gid}", _client(self.host, self.port, self.timeout))
        state = self._groups[gid] = [0, None]
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        try:
            pg = state[1] = make_group(
                self.backend, dist.PrefixStore("pg", store), 0, self.timeout, self.host
            )
            while not self._stop.is_set():
                key = f"h/{state[0]}"
                store.wait([key], FOREVER)
                head = json.loads(store.get(key))
                store.delete_key(key)
                state[0] += 1
                if "rid" not in head:  # the sender left, or close() woke us
                    break
                with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
                    self._receive(store, pg, gid, head)
        except Exception as e:  # its sender is gone or stuck: the rest never comes
            self._lost(gid, f"group failed: {e!r}")
        finally:
            self._groups.pop(gid, None)
            if state[1] is not None:
                _abort(state[1])

    def _receive(self, store, pg, gid: str, head: dict) -> None:
        rid, layer, nbytes = head["rid"], head["layer"], head["bytes"]
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        pg.recv([buf], 1, 0).wait(timedelta(seconds=self.timeout))  # raises: group over
        rx, refuse = self._active(rid, gid)
        if refuse:  # the sender's ack thread reads it once the request is fully sent
            store.set(f"ack/{rid}", "unknown or cancelled request")
        if rx is None:
            return
        error = self._check(rx, layer, head["layout"], head["dst"], nbytes)
        if error:
            self._fail(rid, rx, error)
            store.set(f"ack/{rid}", error)
            return
        self._write(rx, layer, buf)
        if self._landed(rx, layer, nbytes):
            store.set(f"ack/{rid}", "ok")


@dataclass(eq=False)
class _Outgoing:
    plan: LayerPlan
    group: _Group
    done: cf.Future = field(default_factory=cf.Future)
    index: dict = field(default_factory=dict)
    sent: int = 0
    nbytes: int = 0
    t0: float = 0.0


@dataclass(eq=False)
class _Group:
    host: str
    port: int
    backend: str
    layers: queue.Queue = field(default_factory=queue.Queue)  # in engine order
    acks: queue.Queue = field(default_factory=queue.Queue)  # fully sent, in that order
    txs: dict = field(default_factory=dict)
    dead: bool = False
    acking: str | None = None  # the ack key the ack thread blocks on


class NcclSender(KvSender):
    """One sender thread and one ack thread per target; `flush` awaits on any loop."""

    name = "nccl"

    def __init__(self, device=None, timeout: float = 30.0):
        self.device, self.timeout = device, timeout
        self._txs: dict[str, _Outgoing] = {}
        self._groups: dict[tuple[str, int], _Group] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def begin(self, plan: LayerPlan, target: bytes) -> None:
        addr = json.loads(target)
        key = (addr["host"], int(addr["port"]))
        with self._lock:
            group = self._groups.get(key)
            if group is None or group.dead:  # first use, or the last group failed
                group = self._groups[key] = _Group(*key, addr["backend"])
                _start(self._threads, self._run, group)
            tx = group.txs[plan.request_id] = _Outgoing(plan, group)
            self._txs[plan.request_id] = tx
        if group.dead:  # died between the check and the registration
            settle(tx.done, error=TransferError(f"{plan.request_id}: group failed"))

    def send_layer(self, request_id: str, layer: int, cache_layer: torch.Tensor) -> None:
        tx = self._txs.get(request_id)
        if tx is None or tx.done.done():
            return
        tx.t0 = tx.t0 or time.perf_counter()
        ready = None
        if cache_layer.is_cuda:  # the sender thread's stream starts after this layer's compute
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(cache_layer.device))
        tx.group.layers.put((tx, layer, cache_layer, ready))

    async def flush(self, request_id: str, timeout: float) -> TransferStats:
        tx = self._txs.get(request_id)
        if tx is None:
            raise TransferError(f"{request_id}: no transfer begun")
        try:
            return await await_future(tx.done, timeout, request_id)
        finally:
            self._txs.pop(request_id, None)
            tx.group.txs.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        tx = self._txs.pop(request_id, None)
        if tx is not None:
            settle(tx.done, error=TransferError(f"{request_id}: aborted"))

    async def close(self) -> None:
        for group in list(self._groups.values()):
            group.layers.put(None)
        self._groups.clear()
        await asyncio.to_thread(_join, self._threads, self.timeout)

    def _run(self, group: _Group) -> None:
        """The group's sender thread: joins, then sends layers in the order queued."""
        pg = store = None
        try:
            client = _client(group.host, group.port, self.timeout)
            gid = uuid.uuid4().hex
            client.set(f"join/{client.add('joins', 1) - 1}", gid)
            store = dist.PrefixStore(f"g/{gid}", client)
            host = _local_address(group.host, group.port) if group.backend == "gloo" else ""
            pg = make_group(group.backend, dist.PrefixStore("pg", store), 1, self.timeout, host)
            _start(self._threads, self._run_acks, group, gid)
            seq, stream = 0, None
            while (item := group.layers.get()) is not None:
                tx, layer, cache_layer, ready = item
                if tx.done.done():
                    continue
                if ready is not None and stream is None:
                    stream = torch.cuda.Stream(cache_layer.device)
                with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
                    self._send(store, pg, seq, tx, layer, cache_layer, ready)
                seq += 1
            store.set(f"h/{seq}", "{}")  # closed: the receiver's group thread ends
            error: Exception = ConnectionError("sender closed")
        except Exception as e:  # peer gone, timeout, refused: the group is over
            error = e
        group.dead = True
        for rid, tx in list(group.txs.items()):
            settle(tx.done, error=TransferError(f"{rid}: {group.backend} group failed: {error!r}"))
        group.acks.put(None)
        with contextlib.suppress(Exception):
            if group.acking and store is not None:
                store.set(group.acking, "group closed")  # wake the ack thread
        if pg is not None:
            _abort(pg)

    def _send(self, store, pg, seq: int, tx: _Outgoing, layer: int, cache_layer, ready) -> None:
        if ready is not None:  # start after the layer's compute, on our own stream
            torch.cuda.current_stream().wait_event(ready)
        dev = cache_layer.device
        if dev not in tx.index:
            tx.index[dev] = torch.tensor(tx.plan.src_block_ids, device=dev)
        flat = cache_layer.index_select(0, tx.index[dev]).view(-1).view(torch.uint8)
        plan = tx.plan
        head = dict(rid=plan.request_id, layer=layer, layout=layout(cache_layer),
                    blocks=len(plan.src_block_ids), bytes=flat.numel(),
                    dst=plan.dst_block_ids)  # fmt: skip
        store.set(f"h/{seq}", json.dumps(head))
        pg.send([flat], 0, 0).wait(timedelta(seconds=self.timeout))
        if ready is not None:
            torch.cuda.current_stream().synchronize()  # `flat` is freed once the bytes left
        tx.sent += 1
        tx.nbytes += flat.numel()
        if tx.sent == plan.num_layers:
            tx.group.acks.put(tx)

    def _run_acks(self, group: _Group, gid: str) -> None:
        try:
            store = dist.PrefixStore(f"g/{gid}", _client(group.host, group.port, self.timeout))
            while (tx := group.acks.get()) is not None:
                group.acking = key = f"ack/{tx.plan.request_id}"
                if group.dead:
                    return
                store.wait([key], FOREVER)  # woken by the receiver, or by _run on failure
                reply = store.get(key).decode()
                store.delete_key(key)
                plan, seconds = tx.plan, time.perf_counter() - tx.t0
                if reply == "ok":
                    stats = TransferStats(
                        tx.nbytes, seconds, plan.num_layers, len(plan.dst_block_ids)
                    )
                    settle(tx.done, stats)
                else:
                    settle(tx.done, error=TransferError(f"{plan.request_id}: receiver: {reply}"))
        except Exception as e:  # the store (the receiver's process) is gone
            group.dead = True
            for rid, tx in list(group.txs.items()):
                settle(tx.done, error=TransferError(f"{rid}: receiver lost: {e!r}"))
