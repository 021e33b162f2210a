"""Flags two processes share in host memory, written and waited on in stream order.

On a GPU each process registers the flags' pages (mapped), so a stream writes a
flag once the work queued before it is done (`cuStreamWriteValue64`) and a
stream waits for a flag to hold a value without any host thread and without
holding an SM (`cuStreamWaitValue64`); both can be captured in a CUDA graph. A
worker's step then hands a MoE layer to an expert service with no host in the
loop: on an H100 under MPS a hand-off costs 23 us inside a graph
(bench/gpu/memops_probe.py). On the CPU, where work is done when it is issued,
`write` stores at once and `wait` polls on the host, so the same protocol runs
(and is tested) there.

The flags live in a file of /dev/shm (both processes map it by path); the
stream operations are the CUDA driver's, through ctypes.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

_WAIT_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ
_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped
_driver: dict[str, Callable] = {}
# (CUstream, CUdeviceptr, cuuint64_t value, unsigned int flags)
_VALUE_ARGS = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]


class FlagError(RuntimeError):
    """The flags could not be mapped, or the peer failed while this side waited."""


def _cuda(name: str, argtypes: list) -> Callable:
    """A CUDA driver function (its _v2 where there is one)."""
    if name not in _driver:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = getattr(lib, f"{name}_v2", None) or getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
        _driver[name] = fn
    return _driver[name]


def _check(result: int, what: str) -> None:
    if result != 0:
        raise FlagError(f"{what} failed (CUresult {result})")


class StreamFlags:
    """`count` int64 flags at `path`, made zero by the process that creates them."""

    def __init__(self, path: Path, count: int, device: torch.device, create: bool):
        self.path, self.count, self.device = path, count, device
        size = -(-count * 8 // mmap.PAGESIZE) * mmap.PAGESIZE
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.host = memoryview(self._map).cast("q")  # host reads and writes
        self._base = 0  # the flags' device address, on a GPU
        if device.type == "cuda":
            self._register(size)

    def _register(self, size: int) -> None:
        view = ctypes.c_char.from_buffer(self._map)
        address = ctypes.addressof(view)
        del view  # the map can close later only with no exported pointer left
        err = int(torch.cuda.cudart().cudaHostRegister(address, size, _REGISTER_PORTABLE_MAPPED))
        _check(err, "cudaHostRegister of the expert flags")
        self._registered = address
        pointer = ctypes.c_uint64()
        get = _cuda("cuMemHostGetDevicePointer",
                    [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint])  # fmt: skip
        _check(get(ctypes.byref(pointer), ctypes.c_void_p(address), 0), "cuMemHostGetDevicePointer")
        self._base = pointer.value

    def write(self, index: int, value: int) -> None:
        """Sets flag `index` to `value` once the work queued so far is done: from the
        current stream on a GPU (captured into a graph being captured), at once on
        the CPU."""
        if self._base:
            write = _cuda("cuStreamWriteValue64", _VALUE_ARGS)
            stream = torch.cuda.current_stream(self.device).cuda_stream
            _check(write(stream, self._base + 8 * index, value, 0), "cuStreamWriteValue64")
        else:
            self.host[index] = value

    def wait(self, index: int, value: int, alive: Callable[[], None], timeout: float) -> None:
        """Work queued after this starts once flag `index` equals `value`: on a GPU
        the current stream waits (this returns at once); on the CPU this polls,
        calling `alive()` (which raises FlagError for a dead peer) now and then."""
        if self._base:
            wait = _cuda("cuStreamWaitValue64", _VALUE_ARGS)
            stream = torch.cuda.current_stream(self.device).cuda_stream
            _check(wait(stream, self._base + 8 * index, value, _WAIT_EQ), "cuStreamWaitValue64")
            return
        poll(self.host, index, lambda v: v == value, alive, timeout)

    def close(self) -> None:
        if getattr(self, "_registered", 0):
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = 0
        self.host.release()
        self._map.close()


def poll(host: memoryview, index: int, done: Callable[[int], bool], alive: Callable[[], None],
         timeout: float, spin: float = 0.002) -> int:  # fmt: skip
    """Polls `host[index]` until `done(value)`; yields the core between looks for
    `spin` seconds, then sleeps 50 us at a time, calling `alive()` every 0.1 s;
    FlagError after `timeout` seconds. Returns the value."""
    start = time.perf_counter()
    checked = start
    while not done(value := host[index]):
        now = time.perf_counter()
        if now - checked > 0.1:
            alive()
            checked = now
        if now - start > timeout:
            raise FlagError(f"no answer in {timeout:.1f} s")
        if now - start < spin:
            os.sched_yield()
        else:
            time.sleep(5e-5)
    return value
