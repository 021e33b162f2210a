"""The KV store's memory tier mapped into this process: a file in the shared-memory
folder (`yinian-store-*`, made by services/kvstore/memory_region.py) whose blocks
the store lends, so that a worker copies them from here straight to its GPU.

On CUDA the file is pinned (registered with the driver) so those copies run at
the pinned rate. Pinning many GiB takes seconds, and while each registration
runs the kernel holds the process's memory map (a thread that maps memory meanwhile
waits, and every later fault behind it): the file is pinned in chunks, with the
map let go between them, through ctypes (which lets go of the GIL too), so a
worker maps it in the background while it serves. A copy never spans two chunks:
each chunk has a tensor of its own, and blocks lie wholly inside one.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import time
from pathlib import Path

import torch

from basis.host_regions import STORE_PREFIX, shm_dir

logger = logging.getLogger(__name__)
CHUNK_BYTES = 512 << 20  # pinned at a time


class StoreMemory:
    def __init__(self, path: str, size: int, granule: int, cuda: bool):
        """Maps `path` (`size` bytes, blocks of `granule` bytes at multiples of it),
        pinning it on CUDA; OSError when the file is not such a region here. Call it
        in a thread: on CUDA it takes seconds."""
        target = Path(path)
        if target.parent != shm_dir() or not target.name.startswith(STORE_PREFIX):
            raise OSError(f"{path} is not a KV store region in {shm_dir()}")
        fd = os.open(target, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                raise OSError(f"{path} does not hold {size} bytes")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path, self.size = target, size
        self.chunk = max(1, CHUNK_BYTES // granule) * granule
        whole = memoryview(self._map)
        self._chunks = [
            torch.frombuffer(whole[start : start + self.chunk], dtype=torch.uint8)
            for start in range(0, size, self.chunk)
        ]  # fmt: skip
        self._registered: list[int] = []
        if cuda:
            self._pin()

    def _pin(self) -> None:
        runtime = _cuda_runtime()
        for chunk in self._chunks:
            pointer, nbytes = chunk.data_ptr(), chunk.numel()
            if runtime is not None:
                err = runtime.cudaHostRegister(ctypes.c_void_p(pointer), ctypes.c_size_t(nbytes), 0)
            else:  # torch's binding holds the GIL meanwhile
                err = int(torch.cuda.cudart().cudaHostRegister(pointer, nbytes, 0))
            if err != 0:  # what is pinned stays; the rest copies at the pageable rate
                logger.warning("could not pin the KV store's region (error %s)", err)
                return
            self._registered.append(pointer)
            time.sleep(0)  # the memory map is free between chunks

    @property
    def pinned(self) -> bool:
        return len(self._registered) == len(self._chunks)

    def view(self, offset: int, length: int) -> torch.Tensor:
        """`length` bytes at `offset` as a uint8 tensor; ValueError unless they lie
        inside one chunk (blocks at multiples of the granule always do)."""
        index, start = divmod(offset, self.chunk)
        if offset < 0 or length <= 0 or start + length > self.chunk or offset + length > self.size:
            raise ValueError(f"[{offset}, {offset + length}) is not inside one chunk of the region")
        return self._chunks[index][start : start + length]

    def close(self) -> None:
        """Unpins (through ctypes, the GIL let go) and unmaps: call it in a thread."""
        runtime = _cuda_runtime() if self._registered else None
        for pointer in self._registered:
            if runtime is not None:
                runtime.cudaHostUnregister(ctypes.c_void_p(pointer))
            else:
                torch.cuda.cudart().cudaHostUnregister(pointer)
        self._registered = []
        self._chunks = []
        try:
            self._map.close()
        except BufferError:  # a view is still in use; the map goes when it does
            pass


def _cuda_runtime():
    """The CUDA runtime library torch loaded (from this process's mappings)."""
    torch.cuda.init()
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None
