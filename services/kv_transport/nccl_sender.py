"""The sending end of the nccl KV transport (see nccl.py for the protocol)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import contextlib
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from services.kv_transport.base import KvSender, LayerPlan, TransferError, TransferStats
from services.kv_transport.blocks import (
    abort_transfer,
    await_future,
    find_transfer,
    layout,
    settle,
)
from services.kv_transport.nccl_group import (
    FOREVER,
    MESSAGE_BYTES,
    abort_group,
    check_work,
    done_event,
    join_threads,
    local_address,
    make_group,
    poll_event,
    start_thread,
    store_client,
)


@dataclass(eq=False)
class _Outgoing:
    plan: LayerPlan
    group: _Group
    done: cf.Future = field(default_factory=cf.Future)
    index: dict = field(default_factory=dict)
    sent: int = 0
    announced: int = 0  # layers put in messages so far
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
                start_thread(self._threads, self._run, group)
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
        tx = find_transfer(self._txs, request_id, "no transfer begun")
        try:
            return await await_future(tx.done, timeout, request_id)
        finally:
            self._txs.pop(request_id, None)
            tx.group.txs.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        abort_transfer(self._txs, request_id)

    async def close(self) -> None:
        for group in list(self._groups.values()):
            group.layers.put(None)
        self._groups.clear()
        await asyncio.to_thread(join_threads, self._threads, self.timeout)

    def _run(self, group: _Group) -> None:
        """The group's sender thread: joins, then sends layers in the order queued."""
        pg = store = None
        try:
            client = store_client(group.host, group.port, self.timeout)
            gid = uuid.uuid4().hex
            client.set(f"join/{client.add('joins', 1) - 1}", gid)
            store = dist.PrefixStore(f"g/{gid}", client)
            host = local_address(group.host, group.port) if group.backend == "gloo" else ""
            pg = make_group(group.backend, dist.PrefixStore("pg", store), 1, self.timeout, host)
            start_thread(self._threads, self._run_acks, group, gid)
            seq, streams, inflight, held = 0, None, None, collections.deque()
            while True:
                if not held:
                    try:
                        held.append(group.layers.get_nowait())
                    except queue.Empty:  # nothing queued: settle the message on the wire
                        inflight = self._finish(inflight, store)
                        held.append(group.layers.get())
                item = held.popleft()
                if item is None:
                    break
                if item[0].done.done():
                    continue
                batch = self._batch(group, item, held)
                if streams is None and item[3] is not None:  # gather, and wait for sends
                    streams = (torch.cuda.Stream(item[2].device), torch.cuda.Stream(item[2].device))
                sent = self._send(store, pg, seq, batch, streams)
                seq += 1
                inflight = self._finish(inflight, store)  # the next message is gathered meanwhile
                inflight = sent if streams else self._finish(sent, store)
            self._finish(inflight, store)
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
            abort_group(pg)

    @staticmethod
    def _batch(group: _Group, first: tuple, held: collections.deque) -> list[tuple]:
        """`first` and the other layers of its request queued so far, in order, up to
        MESSAGE_BYTES. Everything queued moves to `held` first; the layers taken leave
        it, the rest (other requests, the closing None) keep their order."""
        while True:
            try:
                held.append(group.layers.get_nowait())
            except queue.Empty:
                break
        tx, _, cache_layer, _ = first
        per = len(tx.plan.src_block_ids) * cache_layer[0].numel() * cache_layer.element_size()
        batch, rest = [first], collections.deque()
        for item in held:
            fits = per * (len(batch) + 1) <= MESSAGE_BYTES
            same = item is not None and item[0] is tx and fits
            if same and item[2].shape == cache_layer.shape and item[2].dtype == cache_layer.dtype:
                batch.append(item)
            else:
                rest.append(item)
        held.clear()
        held.extend(rest)
        return batch

    def _send(self, store, pg, seq: int, batch: list[tuple], streams) -> tuple:
        """Gathers the batch's blocks into one buffer, announces and sends it; returns
        (event or None, work, buffer, tx, layers, bytes) for `_finish`."""
        tx, _, first, _ = batch[0]
        gather, waiter = streams or (None, None)
        with torch.cuda.stream(gather) if gather else contextlib.nullcontext():
            for *_, ready in batch:
                if ready is not None:  # start after the layer's compute, on our own stream
                    torch.cuda.current_stream().wait_event(ready)
            if first.device not in tx.index:
                tx.index[first.device] = torch.tensor(tx.plan.src_block_ids, device=first.device)
            index = tx.index[first.device]
            per = index.numel() * first[0].numel() * first.element_size()
            flat = torch.empty(per * len(batch), dtype=torch.uint8, device=first.device)
            for i, (_, _, cache_layer, _) in enumerate(batch):
                out = flat[i * per : (i + 1) * per].view(cache_layer.dtype)
                torch.index_select(
                    cache_layer, 0, index, out=out.view(index.numel(), *cache_layer.shape[1:])
                )
            plan = tx.plan
            tx.announced += len(batch)
            head = dict(rid=plan.request_id, layers=[b[1] for b in batch],
                        layouts=[layout(b[2]) for b in batch], blocks=len(plan.src_block_ids),
                        bytes=flat.numel(), dst=plan.dst_block_ids,
                        last=tx.announced >= plan.num_layers)  # fmt: skip
            store.set(f"h/{seq}", json.dumps(head))
            work = pg.send([flat], 0, 0)
            event = done_event(work, waiter) if waiter is not None else None
            return (event, work, flat, tx, len(batch), flat.numel())

    def _finish(self, sent: tuple | None, store) -> None:
        """Waits for a sent message (keeping its buffer alive until then) and counts it."""
        if sent is None:
            return None
        event, work, _flat, tx, layers, nbytes = sent
        if event is not None:
            poll_event(event, self.timeout, f"{tx.plan.request_id}: send", store)
        check_work(work, self.timeout)
        tx.sent += layers
        tx.nbytes += nbytes
        if tx.sent == tx.plan.num_layers:
            tx.group.acks.put(tx)
        return None

    def _run_acks(self, group: _Group, gid: str) -> None:
        try:
            store = dist.PrefixStore(f"g/{gid}", store_client(group.host, group.port, self.timeout))
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
