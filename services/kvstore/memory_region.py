"""The memory tier's memory: one region cut into slots of one block size.

Where the shared-memory folder has room for all of it, the region is a file
there (`yinian-store-<pid>-<random>`, whose memory is taken as blocks arrive,
or at once where a worker pins it for its GPU), which workers on this host
map: a block the store lends them is copied from here straight to their GPU,
its bytes never passing through the store. Otherwise (no folder, too little room,
`shared=False`) it is private memory in huge pages where the kernel allows.
The file is removed when the region closes, and a later store removes the
files of stores that no longer run.
"""

from __future__ import annotations

import logging
import mmap
import os
import uuid
from pathlib import Path

import numpy as np

from basis.host_regions import STORE_PREFIX, remove_stale, shm_dir

logger = logging.getLogger("services.kvstore")


class MemoryRegion:
    def __init__(self, slots: int, slot_bytes: int, shared: bool = True):
        self.slots, self.slot_bytes = slots, slot_bytes
        self.size = slots * slot_bytes
        self.path: Path | None = None
        self._map = self._shared() if shared else None
        if self._map is None:
            self._map = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                # a first write into a slot then costs one fault per 2 MiB, not per 4 KiB
                self._map.madvise(mmap.MADV_HUGEPAGE)
        self.rows = np.frombuffer(self._map, dtype=np.uint8).reshape(slots, slot_bytes)

    def _shared(self) -> mmap.mmap | None:
        folder = shm_dir()
        path = folder / f"{STORE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            remove_stale(folder, STORE_PREFIX)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            logger.info("memory tier in private memory (%s)", exc)
            return None
        try:
            space = os.statvfs(folder)
            if space.f_bavail * space.f_frsize < self.size:
                raise OSError(f"{folder} has less than {self.size} bytes free")
            os.ftruncate(fd, self.size)
            mapped = mmap.mmap(fd, self.size)
        except OSError as exc:
            path.unlink(missing_ok=True)
            logger.info("memory tier in private memory (%s: %s)", path, exc)
            return None
        finally:
            os.close(fd)
        self.path = path
        return mapped

    @property
    def shared(self) -> tuple[str, int] | None:
        """(path, size) of the file workers map, or None for private memory."""
        return (str(self.path), self.size) if self.path is not None else None

    def close(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None
        self.rows = None
        try:
            self._map.close()
        except BufferError:  # a view is still in use; the map goes when it does
            pass
