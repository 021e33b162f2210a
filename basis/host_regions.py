"""Where workers' host tiers live as shared-memory files, for the engine that
makes them (engine/host_memory.py) and the KV store that maps them
(services/kvstore/regions.py): one folder and one name prefix for both."""

from __future__ import annotations

import os
from pathlib import Path

PREFIX = "yinian-kv-"  # then <pid>-<random>


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
    available at start-up, at most 16 GiB (it is allocated as blocks arrive)."""
    return int(min(available_host_gb() / 8, 16.0) * (1 << 30)) or (64 << 20)
