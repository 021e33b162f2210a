"""The KV store lends blocks of its memory tier: the tier lives in a file in
shared memory, and Lend says where each leading block lies in it, with its
parent and checksum, so a worker on this host copies the bytes out itself.
A lent block stays where it is (neither evicted nor overwritten) while lent;
another tenant is lent nothing; a store whose memory is private, or whose
slots are of another size, lends nothing; bad input is InvalidRequest before
anything changes."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from kvstore_helpers import FP, PAYLOAD_BYTES, chain, memory_harness, payload, run

from basis.host_regions import STORE_PREFIX
from services.common.errors import InvalidRequest
from services.common.kv_checksum import block_checksum
from services.kvstore import memory_tier


def _read(region: tuple[str, int], offset: int) -> bytes:
    with open(region[0], "rb") as f:
        f.seek(offset)
        return f.read(PAYLOAD_BYTES)


async def _put_chain(h, tenant: str, hashes: list[int]) -> None:
    for parent, block_hash in zip([0, *hashes], hashes):
        assert (await h.put(tenant, block_hash, parent=parent)).status == "stored"


def test_lent_blocks_are_read_from_the_stores_shared_file():
    async def body():
        async with memory_harness("", memory_blocks=8) as h:
            hashes = chain(3, start=11)
            await _put_chain(h, "a", hashes)
            lent = await h.store.lend("a", FP, PAYLOAD_BYTES, [*hashes, 99])
            path, size = lent.region
            assert Path(path).name.startswith(STORE_PREFIX) and os.path.getsize(path) == size
            assert lent.slot_bytes == PAYLOAD_BYTES and lent.seconds > 0
            assert len(lent.blocks) == 3  # the leading blocks held, not the unknown one
            for block_hash, parent, (offset, lent_parent, checksum) in zip(
                hashes, [0, *hashes], lent.blocks
            ):
                data = _read(lent.region, offset)
                assert data == payload(block_hash)
                assert (lent_parent, checksum) == (parent, block_checksum(data))
            # another tenant is lent nothing; the region alone, with no hashes
            assert (await h.store.lend("b", FP, PAYLOAD_BYTES, hashes)).blocks == []
            named = await h.store.lend("a", FP, PAYLOAD_BYTES, [])
            assert named.region == lent.region and named.blocks == []
        assert not os.path.exists(path)  # the file goes with the store

    run(body())


def test_a_lent_block_stays_in_place_until_its_lend_ends(monkeypatch):
    monkeypatch.setattr(memory_tier, "LEND_SECONDS", 0.3)

    async def body():
        async with memory_harness("", memory_blocks=2, lease_seconds=0.01) as h:
            hashes = chain(4, start=21)
            await _put_chain(h, "a", hashes[:2])
            lent = await h.store.lend("a", FP, PAYLOAD_BYTES, hashes[:2])
            await asyncio.sleep(0.05)  # the lookup's lease is over; the lend is not
            outcome = await h.put("a", hashes[2])  # a full tier evicts no lent block
            assert outcome.status == "rejected" and outcome.reason == "capacity"
            assert [_read(lent.region, o) for o, _, _ in lent.blocks] == [
                payload(x) for x in hashes[:2]
            ]
            await asyncio.sleep(0.3)  # the lend is over: the least recent goes
            assert (await h.put("a", hashes[2])).status == "stored"
            assert len(await h.get("a", hashes[1:3])) == 2

    run(body())


def test_a_store_lends_nothing_from_private_memory_or_slots_of_another_size(monkeypatch):
    async def body():
        async with memory_harness("", memory_blocks=4) as h:
            hashes = chain(2, start=31)
            await _put_chain(h, "a", hashes)
            other = await h.store.lend("a", FP, 2 * PAYLOAD_BYTES, hashes)
            assert other.region is None and other.blocks == []
        monkeypatch.setenv("YINIAN_SHM_DIR", "/nonexistent-shm-folder")
        async with memory_harness("", memory_blocks=4) as h:
            await _put_chain(h, "a", hashes)
            private = await h.store.lend("a", FP, PAYLOAD_BYTES, hashes)
            assert private.region is None and private.blocks == []
            assert len(await h.get("a", hashes)) == 2  # still served by copies

    run(body())


@pytest.mark.parametrize(
    "args",
    [("a", 0, []), ("a", 1 << 40, []), ("x" * 300, PAYLOAD_BYTES, []),
     ("a", PAYLOAD_BYTES, list(range(20_000)))],
    ids=["no block size", "block too large", "tenant too long", "too many hashes"],
)  # fmt: skip
def test_bad_lend_requests_are_refused_before_anything_changes(args):
    async def body():
        async with memory_harness("", memory_blocks=4) as h:
            tenant, block_bytes, hashes = args
            with pytest.raises(InvalidRequest):
                await h.store.lend(tenant, FP, block_bytes, hashes)
            assert h.store.memory.region is None  # not even opened

    run(body())
