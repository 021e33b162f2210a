"""What the KV transports share: the layout both ends must agree on, the
future helpers, lookup and abort of a transfer by request id, and
`BlockReceiver`, the receiving half of a transport that writes the cache itself
(tcp, nccl): per-request bookkeeping, layout and size checks, cache writes,
completion and cancel."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import struct
import threading
import time
from dataclasses import dataclass, field

import torch

from services.kv_transport.base import KvReceiver, TransferError, TransferStats


def layout(cache_layer: torch.Tensor) -> str:
    """What both sides must agree on: dtype and the shape of one block."""
    return f"{cache_layer.dtype}:{','.join(map(str, cache_layer.shape[1:]))}"


def settle(fut: cf.Future, result=None, error: BaseException | None = None) -> None:
    try:
        fut.set_exception(error) if error else fut.set_result(result)
    except cf.InvalidStateError:  # already failed, completed or cancelled by a timeout
        pass


async def await_future(fut: cf.Future, timeout: float, what: str):
    try:
        return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
    except asyncio.TimeoutError:
        raise TransferError(f"{what}: timed out after {timeout:.1f} s") from None
    except cf.CancelledError:
        raise TransferError(f"{what}: cancelled") from None


def find_transfer(transfers: dict, request_id: str, missing: str):
    """transfers[request_id], or a TransferError that says `missing`."""
    transfer = transfers.get(request_id)
    if transfer is None:
        raise TransferError(f"{request_id}: {missing}")
    return transfer


def abort_transfer(transfers: dict, request_id: str) -> None:
    """Forgets the outgoing transfer `request_id` and fails its `done` future (a no-op when
    there is none)."""
    tx = transfers.pop(request_id, None)
    if tx is not None:
        settle(tx.done, error=TransferError(f"{request_id}: aborted"))


def ids_bytes(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}i", *ids)


@dataclass(eq=False)
class Incoming:
    dst: list[int]
    dst_bytes: bytes  # as frames carry them, for an exact comparison
    index: torch.Tensor  # moved to the cache's device by the first write
    num_layers: int
    done: cf.Future = field(default_factory=cf.Future)
    lock: threading.Lock = field(default_factory=threading.Lock)  # a write vs cancel()
    cancelled: bool = False
    layers: set = field(default_factory=set)
    sources: set = field(default_factory=set)  # connections or groups that delivered
    nbytes: int = 0
    t0: float = 0.0


class BlockReceiver(KvReceiver):
    """What a receiver that writes the cache itself (tcp, nccl) keeps per request."""

    def __init__(self, kv_caches: list[torch.Tensor]):
        self.kv_caches, self.device = kv_caches, kv_caches[0].device
        self._reqs: dict[str, Incoming] = {}
        self._refused: dict[str, None] = {}  # told the sender "unknown" already (bounded)

    def expect(self, request_id: str, dst_block_ids: list[int], num_layers: int) -> None:
        index = torch.tensor(dst_block_ids, dtype=torch.long)
        if len(index) and (index.min() < 0 or index.max() >= self.kv_caches[0].shape[0]):
            raise ValueError(f"{request_id}: destination block ids out of range")
        dst = list(dst_block_ids)
        self._reqs[request_id] = Incoming(dst, ids_bytes(dst), index, num_layers)

    async def wait(self, request_id: str, timeout: float) -> TransferStats:
        rx = find_transfer(self._reqs, request_id, "no transfer expected")
        try:
            return await await_future(rx.done, timeout, request_id)
        finally:
            self.cancel(request_id)

    def cancel(self, request_id: str) -> None:
        rx = self._reqs.pop(request_id, None)
        if rx is not None:
            with rx.lock:  # after this, nothing is written into the request's blocks
                rx.cancelled = True
            settle(rx.done, error=TransferError(f"{request_id}: cancelled"))

    def _active(self, rid: str, source) -> tuple[Incoming | None, bool]:
        """The request if it takes data from `source` (a connection, a group), and
        whether to tell the sender that it is unknown."""
        rx = self._reqs.get(rid)
        if rx is not None:
            if rx.done.done():
                return None, False  # failed already: drain its layers
            rx.sources.add(source)
            rx.t0 = rx.t0 or time.perf_counter()
            return rx, False
        if rid in self._refused:
            return None, False
        self._refused[rid] = None
        if len(self._refused) > 4096:
            self._refused.pop(next(iter(self._refused)))
        return None, True

    def _check(self, rx: Incoming, layer: int, text: str, dst, nbytes: int) -> str | None:
        if layer >= len(self.kv_caches):
            return f"layer {layer} out of range ({len(self.kv_caches)} layers)"
        cache = self.kv_caches[layer]
        if text != layout(cache):
            return f"layout mismatch: sender {text}, receiver {layout(cache)}"
        if dst != (rx.dst_bytes if isinstance(dst, bytes) else rx.dst):
            return "destination blocks differ from those expected"
        if nbytes != len(rx.dst) * cache[0].numel() * cache.element_size():
            return "payload size does not match the block count"
        return None

    def _write(self, rx: Incoming, layer: int, payload: torch.Tensor) -> None:
        """Copies one layer's uint8 payload into the cache on the current stream."""
        self._write_layers(rx, [(layer, payload)])

    def _write_layers(self, rx: Incoming, payloads: list[tuple[int, torch.Tensor]]) -> None:
        """Copies (layer, uint8 payload) pairs into the cache on the current stream and
        waits for them: once this returns (or the request is cancelled) nothing more is
        written into the request's blocks."""
        with rx.lock:
            if rx.cancelled or not rx.dst:
                return
            for layer, payload in payloads:
                cache = self.kv_caches[layer]
                src = payload.view(cache.dtype).view(len(rx.dst), *cache.shape[1:])
                if rx.index.device != cache.device:  # on the writer's stream, not the loop's
                    rx.index = rx.index.to(cache.device)
                cache.index_copy_(0, rx.index, src.to(cache.device, non_blocking=True))
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # ack = "in the cache"

    def _landed(self, rx: Incoming, layer: int, nbytes: int) -> bool:
        """Counts a written layer; True once the request is complete."""
        rx.layers.add(layer)
        rx.nbytes += nbytes
        if len(rx.layers) < rx.num_layers or rx.done.done():
            return False
        seconds = time.perf_counter() - rx.t0
        settle(rx.done, TransferStats(rx.nbytes, seconds, rx.num_layers, len(rx.dst)))
        return True

    def _fail(self, rid: str, rx: Incoming, why: str) -> None:
        settle(rx.done, error=TransferError(f"{rid}: {why}"))

    def _lost(self, source, why: str) -> None:
        for rid, rx in list(self._reqs.items()):
            if source in rx.sources:  # its sender is gone: the rest never comes
                self._fail(rid, rx, why)
