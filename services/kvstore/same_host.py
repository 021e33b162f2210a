"""The KV store's same-host data plane, free of gRPC: PutFrom and GetInto move
blocks between a worker's host tier (a shared-memory region, mapped here) and
the shared tier, so the worker's process only names slots. Every request is
checked whole (region, sizes, offsets) before any block is stored; each block
stored is checksummed here, from the worker's memory, and each block read is
verified before it is written into the worker's memory."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from services.common.errors import InvalidRequest
from services.common.kv_index import check_block_count
from services.kvstore.fingerprint import Fingerprint
from services.kvstore.regions import Regions
from services.kvstore.shared_tier import PutOutcome
from services.kvstore.store import KvStore, check_tenant

# The caller unpins its slots (and may reuse them) once its deadline passes: the store
# stops touching them this long before.
DEADLINE_MARGIN = 1.0


def _time_left(remaining) -> bool:
    left = remaining() if remaining is not None else None
    return left is None or left > DEADLINE_MARGIN


@dataclass(frozen=True, slots=True)
class Region:
    path: str
    size: int
    block_bytes: int


def _check(store: KvStore, region: Region, offsets) -> None:
    if region.block_bytes <= 0 or region.block_bytes > store.max_block_bytes:
        raise InvalidRequest(
            f"block_bytes {region.block_bytes}; at most {store.max_block_bytes} (--max-block-bytes)"
        )
    check_block_count(offsets)
    for offset in offsets:
        if offset + region.block_bytes > region.size:
            raise InvalidRequest(f"a block at offset {offset} ends past the region's end")


async def put_from(
    store: KvStore,
    regions: Regions,
    tenant: str,
    fingerprint: Fingerprint,
    region: Region,
    blocks: list[tuple[int, int, int]],
    remaining=None,
) -> list[tuple[int, PutOutcome]]:
    """Stores (hash, parent, offset) blocks read from the region; (hash, outcome) of
    each stored before the caller's deadline came near (`remaining()`: seconds left)."""
    check_tenant(tenant)
    _check(store, region, [offset for _, _, offset in blocks])
    if not _time_left(remaining):
        return []
    views = await asyncio.to_thread(
        regions.views, region.path, region.size, [o for _, _, o in blocks], region.block_bytes
    )
    if store.memory is not None and store.memory.takes(region.block_bytes):
        # one threaded copy into the memory tier, well inside any deadline
        outcomes = await store.put_views(
            tenant, fingerprint, [(h, p, v) for (h, p, _), v in zip(blocks, views)]
        )
        return [(h, outcome) for (h, _, _), outcome in zip(blocks, outcomes)]
    out = []
    for (block_hash, parent, _), data in zip(blocks, views):
        if not _time_left(remaining):
            break
        [outcome] = await store.put_views(tenant, fingerprint, [(block_hash, parent, data)])
        out.append((block_hash, outcome))
    return out


async def get_into(
    store: KvStore,
    regions: Regions,
    tenant: str,
    fingerprint: Fingerprint,
    region: Region,
    hashes: list[int],
    offsets: list[int],
    remaining=None,
) -> list[tuple[int, int]]:
    """Writes the leading blocks the shared tier serves into the region at their
    offsets, while the caller's deadline is not near; (parent hash, checksum) of each
    written."""
    check_tenant(tenant)
    if len(offsets) != len(hashes):
        raise InvalidRequest(f"{len(hashes)} block hashes but {len(offsets)} offsets")
    _check(store, region, offsets)
    if not _time_left(remaining):
        return []
    views = await asyncio.to_thread(
        regions.views, region.path, region.size, offsets, region.block_bytes
    )
    if not hashes:  # a worker naming its region ahead of any block: mapped, nothing more
        return []
    return await store.get_into(
        tenant, fingerprint, hashes, views, late=lambda: not _time_left(remaining)
    )
