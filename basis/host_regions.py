"""Where host memory shared between processes of one host lives: workers' host
tiers (engine/host_memory.py makes them, services/kvstore/regions.py maps
them) and the KV store's memory tier (services/kvstore/memory_region.py makes
it, workers map it to copy lent blocks straight to their GPUs). One folder,
one name prefix for each kind, the owner's pid in every name."""

from __future__ import annotations

import os
from pathlib import Path

PREFIX = "yinian-kv-"  # a worker's host tier, then <pid>-<random>
STORE_PREFIX = "yinian-store-"  # the KV store's memory tier, then <pid>-<random>


def shm_dir() -> Path:
    """The shared-memory folder: /dev/shm, or YINIAN_SHM_DIR."""
    return Path(os.environ.get("YINIAN_SHM_DIR", "/dev/shm"))


def available_host_gb() -> float:
    """MemAvailable of /proc/meminfo in GiB (0 where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return 0.0


def default_store_memory_bytes() -> int:
    """The memory tier `yinian up` gives the KV store: an eighth of the host memory
    available at start-up, at most 16 GiB (allocated as blocks arrive, or when GPU
    workers on the host pin it to copy lent blocks)."""
    return int(min(available_host_gb() / 8, 16.0) * (1 << 30)) or (64 << 20)


def remove_stale(folder: Path, prefix: str) -> None:
    """Removes the `prefix` files of processes that have ended (one killed with -9
    leaves its file behind)."""
    for path in folder.glob(f"{prefix}*"):
        try:
            pid = int(path.name[len(prefix) :].split("-")[0])
        except ValueError:
            continue
        if not pid_alive(pid):
            path.unlink(missing_ok=True)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs: an exited one its parent has not reaped yet (a
    zombie) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]  # after "(comm)", which may hold ")"
    except (OSError, IndexError):
        return True
    return state != b"Z"
