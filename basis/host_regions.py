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
