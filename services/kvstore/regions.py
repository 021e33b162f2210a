"""Workers' host tiers as the KV store maps them: shared-memory files on this
host (engine/host_memory.py), opened once and kept mapped, so that PutFrom
reads a block's bytes straight out of a worker's host tier and GetInto writes
them straight in. Only files named like a host tier, in the shared-memory
folder, of the size the caller says, are opened; every block must lie inside.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
from collections import OrderedDict
from pathlib import Path

from basis.host_regions import PREFIX, shm_dir
from services.common.errors import FailedPrecondition, InvalidRequest

_MAX_OPEN = 64
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_POPULATE_CHUNK = 64 << 20
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


class RegionUnavailable(FailedPrecondition):
    """The region is not on this host (or not readable here)."""


class Regions:
    def __init__(self, folder: Path | None = None):
        self.folder = folder or shm_dir()
        self._open: OrderedDict[tuple[str, int], tuple[mmap.mmap, int]] = OrderedDict()
        self._lock = threading.Lock()  # views() maps in a thread

    def views(self, path: str, size: int, offsets, length: int) -> list[memoryview]:
        """`length` bytes at each of `offsets` of the region, readable and writable;
        the region is mapped (and checked) once, so call it in a thread."""
        for offset in offsets:
            if length <= 0 or offset < 0 or offset + length > size:
                raise InvalidRequest(f"block [{offset}, {offset + length}) outside the region")
        whole = memoryview(self._map(path, size))
        return [whole[offset : offset + length] for offset in offsets]

    def view(self, path: str, size: int, offset: int, length: int) -> memoryview:
        """`length` bytes at `offset` of the region, readable and writable."""
        return self.views(path, size, [offset], length)[0]

    def _map(self, path: str, size: int) -> mmap.mmap:
        with self._lock:
            return self._map_locked(path, size)

    def _map_locked(self, path: str, size: int) -> mmap.mmap:
        target = Path(path)
        if target.parent != self.folder or not target.name.startswith(PREFIX):
            raise InvalidRequest(f"{path} is not a host tier in {self.folder}")
        key = (path, size)
        entry = self._open.get(key)
        if entry is not None:
            mapped, ino = entry
            if _inode(target) == ino:  # not removed and made again by another worker
                self._open.move_to_end(key)
                return mapped
            self._close(key)
        self._drop_removed()
        try:
            fd = os.open(target, os.O_RDWR)
        except OSError as exc:
            raise RegionUnavailable(f"cannot open {path} here ({exc})") from exc
        try:
            stat = os.fstat(fd)
            if stat.st_size != size:
                raise RegionUnavailable(f"{path} holds {stat.st_size} bytes, not {size}")
            mapped = mmap.mmap(fd, size)
            if stat.st_blocks * 512 >= size:
                # all its memory is there (a host tier pinned for a GPU): map every page
                # in the background, so that copies into it take no faults
                threading.Thread(target=_populate, args=(mapped, size), daemon=True).start()
        finally:
            os.close(fd)
        self._open[key] = (mapped, stat.st_ino)
        while len(self._open) > _MAX_OPEN:
            self._close(next(iter(self._open)))
        return mapped

    def _drop_removed(self) -> None:
        """Unmaps the regions whose file is gone (a worker that stopped or was replaced):
        a mapping would keep a removed file's memory alive."""
        for key, (_, ino) in list(self._open.items()):
            if _inode(Path(key[0])) != ino:
                self._close(key)

    def _close(self, key, wait: bool = False) -> None:
        """Unmaps a region: in the background unless `wait` (unmapping the last
        mapping of a removed worker's 16 GiB frees it, which takes seconds; the
        call releases the GIL, so the store serves on meanwhile)."""
        mapped, _ = self._open.pop(key)
        if wait:
            _unmap(mapped)
        else:
            threading.Thread(target=_unmap, args=(mapped,), daemon=True).start()

    def close(self) -> None:
        with self._lock:
            for key in list(self._open):
                self._close(key, wait=True)


def _unmap(mapped: mmap.mmap) -> None:
    try:
        mapped.close()
    except BufferError:  # a view is still in use; the map goes when it does
        pass


def _populate(mapped: mmap.mmap, size: int) -> None:
    """madvise(MADV_POPULATE_WRITE) over the mapping through ctypes, which lets go of
    the GIL (mmap.madvise holds it for the whole call: seconds for many GiB)."""
    try:
        anchor = ctypes.c_char.from_buffer(mapped)
    except (TypeError, ValueError, BufferError):  # closed meanwhile
        return
    try:
        base = ctypes.addressof(anchor)
        for offset in range(0, size, _POPULATE_CHUNK):
            length = min(_POPULATE_CHUNK, size - offset)
            if _LIBC.madvise(ctypes.c_void_p(base + offset), ctypes.c_size_t(length),
                             _MADV_POPULATE_WRITE) != 0:  # fmt: skip
                return  # an older kernel
    finally:
        del anchor


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None
