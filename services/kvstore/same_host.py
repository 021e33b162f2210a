"""The KV store's same-host data plane, free of gRPC: PutFrom and GetInto move
blocks between a worker's host tier (a shared-memory region, mapped here) and
the shared tier, so the worker's process only names slots. Every request is
checked whole (region, sizes, offsets) before any block is stored; each block
stored is checksummed here, from the worker's memory, and each block read is
verified before it is written into the worker's memory."""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass

from services.common.errors import InvalidRequest
from services.common.kv_checksum import block_checksum
from services.kvstore.fingerprint import Fingerprint
from services.kvstore.regions import Regions
from services.kvstore.shared_tier import PutOutcome
from services.kvstore.store import KvStore, check_hashes, check_tenant

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
    check_hashes(offsets)
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
    views = [regions.view(region.path, region.size, o, region.block_bytes) for _, _, o in blocks]
    out = []
    for (block_hash, parent, _), data in zip(blocks, views):
        if not _time_left(remaining):
            break
        outcome = await store.put(
            tenant, fingerprint, block_hash, parent, data, block_checksum(data)
        )
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
    views = [regions.view(region.path, region.size, o, region.block_bytes) for o in offsets]
    out: list[tuple[int, int]] = []
    async with aclosing(store.get(tenant, fingerprint, hashes)) as blocks:
        async for block in blocks:
            if len(block.payload) != region.block_bytes or not _time_left(remaining):
                break  # another layout's block under this fingerprint (a miss), or late
            views[len(out)][:] = block.payload
            out.append((block.parent_hash, block.checksum))
    return out
