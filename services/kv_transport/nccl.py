"""KV blocks over torch.distributed point-to-point: NCCL for CUDA caches, gloo
for CPU caches, with the same logic.

Rendezvous: the receiver hosts a TCPStore (`target()` = {"host", "port",
"backend"}). A sender joins with a fresh group id (`n = add("joins", 1) - 1`,
`set("join/<n>", gid)`); the receiver's acceptor thread takes joins in order,
and both sides build a 2-rank backend (rank 0 receiver, rank 1 sender) straight
on `PrefixStore("g/<gid>/pg")` -- backend objects, not the global default
group, so any number of pairs coexist in one process.

Data and control: a message is one contiguous uint8 tensor through the group's
send/recv holding one or more layers' blocks of one request: the sender
gathers every layer already queued for the request (up to MESSAGE_BYTES) into
one message, so layers that the prefill produces slowly go one by one while a
backlog goes in few large messages. The sender gathers the next message while
the last is on the wire. A header key "g/<gid>/h/<seq>" in the store (request,
layers, block count and ids, bytes, layouts) announces every message, and
the receiver's per-group thread blocks on it, so a recv is only posted when its
data is on the way: an idle posted NCCL recv would hold SMs and trip the
watchdog, and a gloo recv that times out closes the pair. The message holding
a request's last layer is marked "last"; after it the receiver writes one
"g/<gid>/ack/<request>" ("ok" once every layer is in the cache, or why not),
which the sender's ack thread turns into the result of flush(). The
receiving thread is per group rather than started by expect(): the receiver
cannot know which sender (group) a request will arrive on, and the headers
carry the request id, so expect() only registers the destination blocks.

Completion is read from a CUDA event polled against a deadline (the timed wait
of a NCCL work sleeps in millisecond steps, which would cost more than moving
a layer), then the op's own status is checked: an aborted communicator also
completes its event. A sender stops waiting as soon as the receiver's store
stops answering (the receiver's process is gone).

Failures: sends and recvs have timeouts; a failed one ends the group and fails
its in-flight requests with TransferError, and the sender's next begin() for
that target forms a new group. Store waits block without a timeout (timed-out
waits log at C++ level) and are woken by writing the awaited key.
The source blocks must stay allocated until flush() returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from services.kv_transport.blocks import BlockReceiver
from services.kv_transport.nccl_group import (
    FOREVER,
    abort_group,
    complete,
    join_threads,
    make_group,
    start_thread,
    store_client,
)
from services.kv_transport.nccl_sender import NcclSender

__all__ = ["NcclReceiver", "NcclSender"]


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
        start_thread(self._threads, self._accept)

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
                abort_group(pg)
        for rid in list(self._reqs):
            self.cancel(rid)
        await asyncio.to_thread(join_threads, self._threads, self.timeout)

    def _accept(self) -> None:
        with contextlib.suppress(Exception):  # the store goes away with close()
            store = store_client(self.host, self.port, self.timeout)
            while not self._stop.is_set():
                key = f"join/{self._joins}"
                store.wait([key], FOREVER)
                gid = store.get(key).decode()
                store.delete_key(key)
                self._joins += 1
                if gid and not self._stop.is_set():
                    start_thread(self._threads, self._serve, gid)

    def _serve(self, gid: str) -> None:
        """Receives one group's messages in order until its sender leaves or fails."""
        store = dist.PrefixStore(f"g/{gid}", store_client(self.host, self.port, self.timeout))
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
                abort_group(state[1])

    def _receive(self, store, pg, gid: str, head: dict) -> None:
        rid, nbytes = head["rid"], head["bytes"]
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        complete(pg.recv([buf], 1, 0), buf, self.timeout, f"{rid}: recv")  # raises: group over
        rx, _ = self._active(rid, gid)
        if rx is not None:
            self._take(rx, rid, head, buf)
        if head.get("last"):  # the sender's ack thread waits for exactly one answer
            store.set(f"ack/{rid}", self._outcome(rid, rx or self._reqs.get(rid)))

    def _take(self, rx, rid: str, head: dict, buf: torch.Tensor) -> None:
        """Checks one message's layers and writes them, or fails the request."""
        layers, layouts, nbytes = head["layers"], head["layouts"], head["bytes"]
        per = nbytes // max(1, len(layers))
        if not layers or len(layouts) != len(layers) or per * len(layers) != nbytes:
            self._fail(rid, rx, "message header does not match its payload")
            return
        for layer, text in zip(layers, layouts):
            error = self._check(rx, layer, text, head["dst"], per)
            if error:
                self._fail(rid, rx, error)
                return
        self._write_layers(rx, [(n, buf[i * per : (i + 1) * per]) for i, n in enumerate(layers)])
        for layer in layers:
            self._landed(rx, layer, per)

    def _outcome(self, rid: str, rx) -> str:
        """'ok' once every layer of the request is in the cache, else why not. `rx` is
        the request as this message found it: a completed one may already have left
        the table (its waiter took the result)."""
        if rx is None:
            return "unknown or cancelled request"
        if not rx.done.done():
            self._fail(rid, rx, "the last message came before every layer")
        try:
            error = rx.done.exception(timeout=0)
        except BaseException as e:  # cancelled
            error = e
        return "ok" if error is None else str(error) or repr(error)
