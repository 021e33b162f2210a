"""The host tier's memory: one tensor in a shared-memory file, so that another
process on this host (the KV store) can read blocks out of it and write
blocks into it directly, without their bytes passing through the engine's
process; pinned on CUDA (registered with the driver) so device copies to and
from it are asynchronous.

The file is `yinian-kv-<pid>-<random>` in the shared-memory folder
(`/dev/shm`, or `YINIAN_SHM_DIR`); it is removed when the tier closes, and a
later start removes the files of processes that no longer run (a worker
killed with -9 leaves its file behind). Where the folder is missing or too
small, the tier is ordinary pinned memory that only this process sees.

`map_store_region` maps the KV store's memory tier (another process's file in
the same folder) the same way, so the store can lend blocks that this process
copies straight to its GPU.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from basis.host_regions import PREFIX, STORE_PREFIX, remove_stale, shm_dir

logger = logging.getLogger(__name__)


@dataclass
class HostMemory:
    tensor: torch.Tensor
    path: Path | None = None  # the shared-memory file, None for private memory
    registered: bool = False
    owned: bool = True  # made here: its file goes when it closes

    @property
    def size(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def close(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.registered = False
        if self.path is not None and self.owned:
            self.path.unlink(missing_ok=True)
        self.path = None


def allocate(shape: tuple[int, ...], dtype: torch.dtype, cuda: bool) -> HostMemory:
    """`shape` of `dtype` in a shared-memory file when one fits, else private (pinned
    on CUDA) memory."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    folder = shm_dir()
    try:
        remove_stale(folder, PREFIX)
        space = os.statvfs(folder)
        if space.f_bavail * space.f_frsize < nbytes:
            raise OSError(f"{folder} has less than {nbytes} bytes free")
        path = folder / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tensor = torch.from_file(str(path), shared=True, size=math.prod(shape), dtype=dtype)
    except (OSError, RuntimeError) as exc:
        logger.info("host tier in private memory (%s)", exc)
        return HostMemory(torch.empty(shape, dtype=dtype, pin_memory=cuda))
    memory = HostMemory(tensor.view(shape), path)
    # an engine dropped without close() (or the process ending) removes its file too
    weakref.finalize(memory, path.unlink, missing_ok=True)
    if cuda:
        err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
        if int(err) != 0:
            memory.close()
            logger.warning("could not pin the shared host tier (error %s); private memory", err)
            return HostMemory(torch.empty(shape, dtype=dtype, pin_memory=True))
        memory.registered = True
    return memory


def map_store_region(path: str, size: int, cuda: bool) -> HostMemory:
    """The KV store's memory tier, a file of `size` bytes in the shared-memory folder,
    mapped here as one uint8 tensor and, on CUDA, registered with the driver (so
    copies out of it to the device run at the pinned rate; a few seconds for many
    GiB: call it in a thread). OSError when the file is not such a region here."""
    target = Path(path)
    if target.parent != shm_dir() or not target.name.startswith(STORE_PREFIX):
        raise OSError(f"{path} is not a KV store region in {shm_dir()}")
    fd = os.open(target, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != size:
            raise OSError(f"{path} does not hold {size} bytes")
        mapped = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    memory = HostMemory(torch.frombuffer(mapped, dtype=torch.uint8), target, owned=False)
    if cuda:
        err = _register_without_gil(memory.tensor.data_ptr(), size)
        if err != 0:  # still usable, at the pageable rate
            logger.warning("could not pin the KV store's region (error %s)", err)
        else:
            memory.registered = True
    return memory


def _register_without_gil(pointer: int, size: int) -> int:
    """cudaHostRegister through ctypes, which lets go of the GIL: pinning many GiB
    takes seconds, and torch's binding would hold every other thread of the process
    (its event loop, its metrics) for all of them. torch's binding where the CUDA
    runtime library cannot be found."""
    runtime = _cuda_runtime()
    if runtime is None:
        return int(torch.cuda.cudart().cudaHostRegister(pointer, size, 0))
    return runtime.cudaHostRegister(ctypes.c_void_p(pointer), ctypes.c_size_t(size), 0)


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
