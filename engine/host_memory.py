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
"""

from __future__ import annotations

import logging
import math
import os
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from basis.host_regions import PREFIX, remove_stale, shm_dir

logger = logging.getLogger(__name__)
_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped


@dataclass
class HostMemory:
    tensor: torch.Tensor
    path: Path | None = None  # the shared-memory file, None for private memory
    registered: bool = False

    @property
    def size(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def close(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.registered = False
        if self.path is not None:
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
        # portable and mapped: any device may read and write it, copies or kernels
        # (kernels/host_blocks.py stores blocks into it from the device)
        err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, _PORTABLE_MAPPED)
        if int(err) != 0:
            memory.close()
            logger.warning("could not pin the shared host tier (error %s); private memory", err)
            return HostMemory(torch.empty(shape, dtype=dtype, pin_memory=True))
        memory.registered = True
    return memory
