"""A worker maps the KV store's memory tier (a file in shared memory that the store
made): every view reads the store's bytes; a view is never allowed across two of
the chunks the region is pinned in (a block lies inside one); a file that is not
a store region, or not of the size named, is refused."""

from __future__ import annotations

import numpy as np
import pytest

from engine import store_memory
from engine.store_memory import StoreMemory
from services.kvstore.memory_region import MemoryRegion

SLOT = 4096


@pytest.fixture()
def region(monkeypatch, tmp_path):
    monkeypatch.setenv("YINIAN_SHM_DIR", str(tmp_path))
    monkeypatch.setattr(store_memory, "CHUNK_BYTES", 3 * SLOT)  # 10 slots in 4 chunks
    made = MemoryRegion(10, SLOT)
    made.rows[:] = np.random.default_rng(1).integers(0, 256, made.rows.shape, dtype=np.uint8)
    yield made
    made.close()


def test_views_read_the_stores_bytes_and_never_span_two_chunks(region):
    path, size = region.shared
    mapped = StoreMemory(path, size, SLOT, cuda=False)
    try:
        for slot in range(10):
            assert bytes(mapped.view(slot * SLOT, SLOT).numpy()) == region.rows[slot].tobytes()
        region.rows[4][7] ^= 0xFF  # the store writes; the mapping sees it
        assert mapped.view(4 * SLOT, SLOT)[7].item() == region.rows[4][7]
        with pytest.raises(ValueError):
            mapped.view(2 * SLOT, 2 * SLOT)  # slots 2 and 3: two chunks
        with pytest.raises(ValueError):
            mapped.view(9 * SLOT, 2 * SLOT)  # past the end
    finally:
        mapped.close()


def test_only_a_store_region_of_the_named_size_is_mapped(region, tmp_path):
    path, size = region.shared
    with pytest.raises(OSError):
        StoreMemory(path, size + SLOT, SLOT, cuda=False)
    other = tmp_path / "yinian-kv-1-abc"  # a worker's host tier, not the store's
    other.write_bytes(b"\0" * size)
    with pytest.raises(OSError):
        StoreMemory(str(other), size, SLOT, cuda=False)
