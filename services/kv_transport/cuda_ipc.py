"""KV blocks between GPUs of one host through CUDA IPC: the sender maps the
receiver's cache tensors into its own process and copies GPU memory to GPU
memory, with no host copy.

`target()` is a pickle of plain values only (loading it refuses every global,
so it runs no code): per layer, the arguments of torch's own
`rebuild_cuda_tensor` as `reduce_tensor` makes them (the cudaIpcMemHandle from
`storage._share_cuda_()`, offsets, sizes, the ref-counter and event handles),
with classes and dtype left for the sender to fill in; the GPU's uuid and
index; the process (pid, pid namespace); the cache layout. The sender finds
that GPU among its own by uuid (CUDA_VISIBLE_DEVICES may number it otherwise),
so both processes must see it, and must share /dev/shm and the IPC namespace.

Completion: the data path has no receiver-side activity, so the receiver cannot
see a transfer end. The prefill side's flush() returns once the copies are done
on the GPU; it reports that to the decode side (its own RPC), which then calls
`mark_done(request_id, stats)` (or `mark_failed`) -- what `wait()` returns on.
For the same reason cancel() cannot stop copies already issued: the decode side
must not reuse a cancelled request's blocks before the prefill side has
flushed or failed.

Copies: `send_layer` (engine thread) makes a dedicated copy stream wait for the
current stream (the layer's compute) and issues the copy there, so it overlaps
the next layers' compute; `kernels.block_copy` picks the fewest passes over memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import inspect
import io
import os
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from basis.host_regions import pid_alive
from kernels.block_copy import CopyPlan, copy_blocks, make_copy_plan
from services.kv_transport.base import (
    KvReceiver,
    KvSender,
    LayerPlan,
    TransferError,
    TransferStats,
)
from services.kv_transport.blocks import await_future, find_transfer, settle

try:  # present in every torch 2.x build, CPU ones included; guarded all the same
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor
except ImportError:  # pragma: no cover
    rebuild_cuda_tensor = reduce_tensor = None
_LOCAL = ("tensor_cls", "storage_cls", "dtype", "storage_device")  # filled in by the sender


def pid_namespace() -> str:
    with contextlib.suppress(OSError):
        return os.readlink("/proc/self/ns/pid")
    return ""


def _plain(value):
    if isinstance(value, torch.Size):
        return tuple(value)
    return value.index if isinstance(value, torch.device) else value


def describe(kv_caches: list[torch.Tensor]) -> dict:
    """The receiver's side of the handshake: IPC handles and layout, plain values only."""
    if reduce_tensor is None or not kv_caches[0].is_cuda:
        raise TransferError("cuda_ipc needs CUDA caches")
    layers = []
    for t in kv_caches:
        rebuild, args = reduce_tensor(t)
        names = list(inspect.signature(rebuild).parameters)
        layers.append({n: _plain(v) for n, v in zip(names, args) if n not in _LOCAL})
    dev = kv_caches[0].device
    props = torch.cuda.get_device_properties(dev)
    return {
        "version": 1, "pid": os.getpid(), "pidns": pid_namespace(),
        "device_uuid": str(getattr(props, "uuid", "")), "device_index": dev.index,
        "dtype": str(kv_caches[0].dtype).removeprefix("torch."),
        "shape": tuple(kv_caches[0].shape), "layers": layers,
    }  # fmt: skip


class PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"cuda_ipc target names {module}.{name}: refused")


def _local_device(uuid: str, index: int) -> int:
    for i in range(torch.cuda.device_count()):
        if uuid and str(getattr(torch.cuda.get_device_properties(i), "uuid", "")) == uuid:
            return i
    if uuid:
        raise TransferError(f"the receiver's GPU {uuid} is not visible in this process")
    return index


def open_remote(desc: dict) -> list[torch.Tensor]:
    """The receiver's cache tensors, mapped into this process."""
    device = _local_device(desc["device_uuid"], desc["device_index"])
    params = inspect.signature(rebuild_cuda_tensor).parameters
    local = {"tensor_cls": torch.Tensor, "storage_cls": torch.storage.TypedStorage,
             "dtype": getattr(torch, desc["dtype"]), "storage_device": device}  # fmt: skip
    tensors = []
    for layer in desc["layers"]:
        args = {**layer, **local}
        missing = [p for p in params if p not in args]
        if missing:
            raise TransferError(f"torch versions disagree on CUDA IPC (missing {missing})")
        tensors.append(rebuild_cuda_tensor(**{p: args[p] for p in params}))
    return tensors


class CudaIpcReceiver(KvReceiver):
    name = "cuda_ipc"

    def __init__(self, kv_caches: list[torch.Tensor]):
        self.kv_caches = kv_caches
        self._reqs: dict[str, cf.Future] = {}
        self._target: bytes | None = None

    async def start(self) -> None:
        pass

    def target(self) -> bytes:
        if self._target is None:  # each reduce_tensor call makes new ref counters: once
            target = pickle.dumps(describe(self.kv_caches))
            PlainUnpickler(io.BytesIO(target)).load()  # fails here, not at every sender
            self._target = target
        return self._target

    def expect(self, request_id: str, dst_block_ids: list[int], num_layers: int) -> None:
        self._reqs[request_id] = cf.Future()

    async def wait(self, request_id: str, timeout: float) -> TransferStats:
        fut = find_transfer(self._reqs, request_id, "no transfer expected")
        try:
            return await await_future(fut, timeout, request_id)
        finally:
            self._reqs.pop(request_id, None)

    def mark_done(self, request_id: str, stats: TransferStats | None = None) -> None:
        """The sender's flush() succeeded: the blocks are in this cache."""
        if request_id in self._reqs:
            settle(self._reqs[request_id], stats if stats is not None else TransferStats())

    def mark_failed(self, request_id: str, why: str) -> None:
        if request_id in self._reqs:
            settle(self._reqs[request_id], error=TransferError(f"{request_id}: {why}"))

    def cancel(self, request_id: str) -> None:
        fut = self._reqs.pop(request_id, None)
        if fut is not None:
            settle(fut, error=TransferError(f"{request_id}: cancelled"))


@dataclass(eq=False)
class _Outgoing:
    plan: LayerPlan
    remote: list[torch.Tensor]
    copy: CopyPlan
    keep: list  # pinned index tensors until their uploads are done
    sent: threading.Event = field(default_factory=threading.Event)
    done_event: torch.cuda.Event | None = None
    error: str | None = None
    layers: int = 0
    nbytes: int = 0
    t0: float = 0.0


class CudaIpcSender(KvSender):
    name = "cuda_ipc"

    def __init__(self, device=None):
        self.device = torch.device(device) if device is not None else None
        self._remote: dict[bytes, list[torch.Tensor]] = {}
        self._txs: dict[str, _Outgoing] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="kv-ipc-flush")

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def begin(self, plan: LayerPlan, target: bytes) -> None:
        try:
            desc = PlainUnpickler(io.BytesIO(target)).load()
            # Its cache died with it: writing there would fault this process's context.
            if desc["pidns"] == pid_namespace() and not pid_alive(desc["pid"]):
                self._remote.pop(target, None)
                raise TransferError(f"{plan.request_id}: receiver process is gone")
            if target not in self._remote:
                self._remote[target] = open_remote(desc)
        except (RuntimeError, KeyError, pickle.UnpicklingError) as e:
            if isinstance(e, TransferError):
                raise
            raise TransferError(f"{plan.request_id}: cannot open the receiver's cache: {e}") from e
        remote = self._remote[target]
        if len(remote) < plan.num_layers or max(plan.dst_block_ids, default=0) >= len(remote[0]):
            raise TransferError(f"{plan.request_id}: plan does not fit the receiver's cache")
        src_dev = self.device or torch.device("cuda", torch.cuda.current_device())
        keep, indexes = [], []
        for ids, dev in ((plan.src_block_ids, src_dev), (plan.dst_block_ids, remote[0].device)):
            host = torch.tensor(ids, dtype=torch.long).pin_memory()
            with torch.cuda.stream(self._stream(dev)):  # ordered before this request's copies
                indexes.append(host.to(dev, non_blocking=True))
            keep.append(host)
        copy = make_copy_plan(plan.src_block_ids, plan.dst_block_ids, *indexes)
        self._txs[plan.request_id] = _Outgoing(plan, remote, copy, keep)

    def send_layer(self, request_id: str, layer: int, cache_layer: torch.Tensor) -> None:
        tx = self._txs.get(request_id)
        if tx is None or tx.error:
            return
        tx.t0 = tx.t0 or time.perf_counter()
        dst = tx.remote[layer]
        if dst.shape[1:] != cache_layer.shape[1:] or dst.dtype != cache_layer.dtype:
            tx.error = f"layout mismatch: {cache_layer.dtype} {tuple(cache_layer.shape[1:])} here,"
            tx.error += f" {dst.dtype} {tuple(dst.shape[1:])} at the receiver"
            tx.sent.set()  # flush() reports it
            return
        src_stream, dst_stream = self._stream(cache_layer.device), self._stream(dst.device)
        src_stream.wait_stream(torch.cuda.current_stream(cache_layer.device))  # layer computed
        cross = dst_stream if dst.device != cache_layer.device else None
        with torch.cuda.stream(src_stream), torch.cuda.stream(cross):
            copy_blocks(cache_layer, dst, tx.copy)
        tx.layers += 1
        tx.nbytes += len(tx.copy.src_ids) * cache_layer[0].numel() * cache_layer.element_size()
        if tx.layers == tx.plan.num_layers:
            # Cross-device copies end with the destination stream waiting on them,
            # so one event there covers the whole request.
            tx.done_event = torch.cuda.Event()
            tx.done_event.record(dst_stream)
            tx.sent.set()

    async def flush(self, request_id: str, timeout: float) -> TransferStats:
        tx = find_transfer(self._txs, request_id, "no transfer begun")
        loop = asyncio.get_running_loop()
        try:  # the GPU wait runs on a worker thread: the event loop never blocks
            return await loop.run_in_executor(self._pool, self._finish, tx, timeout)
        finally:
            self._txs.pop(request_id, None)

    def _finish(self, tx: _Outgoing, timeout: float) -> TransferStats:
        deadline = time.monotonic() + timeout
        rid = tx.plan.request_id
        if not tx.sent.wait(timeout):
            raise TransferError(f"{rid}: {tx.layers}/{tx.plan.num_layers} layers sent by timeout")
        if tx.error:  # copies of earlier layers may still run: they target its own blocks
            raise TransferError(f"{rid}: {tx.error}")
        while not tx.done_event.query():  # a poll, so the timeout holds even if the GPU hangs
            if time.monotonic() > deadline:
                raise TransferError(f"{rid}: copies not complete after {timeout:.1f} s")
            time.sleep(5e-5)
        seconds = time.perf_counter() - tx.t0
        return TransferStats(tx.nbytes, seconds, tx.layers, len(tx.copy.src_ids))

    def abort(self, request_id: str) -> None:
        self._txs.pop(request_id, None)  # copies already issued still run

    async def close(self) -> None:
        self._txs.clear()
        self._remote.clear()  # unmaps once the last copy using them is freed
        self._pool.shutdown(wait=False)
