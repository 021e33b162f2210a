"""The KV store's memory tier in front of a real Redis: blocks put are served
back byte for byte without Redis; a full memory tier spills what it evicts
into Redis, from where it is still served; a tenant over its quota evicts
only its own blocks; leased blocks are never evicted; a block whose bytes
changed in memory is never returned; a block of another size goes to Redis;
and the announced set (SharedKvEvents) follows what either tier holds."""

from __future__ import annotations

import asyncio

import pytest
from kvstore_helpers import (  # noqa: F401 - fixtures
    FP,
    PAYLOAD_BYTES,
    chain,
    memory_harness,
    payload,
    run,
    server_fixture,
    url_fixture,
)
from redis_server import redis_server_binary

from services.common.kv_checksum import block_checksum

pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="no redis-server")


def _announced(h) -> set[int]:
    held: set[int] = set()
    for batch in h.events.batches():
        held |= set(batch.stored)
        held -= set(batch.removed)
    return held


async def _spilled(h) -> None:
    drain = asyncio.create_task(h.spiller.drain())
    for _ in range(200):
        if h.spiller.queued_bytes == 0:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # the last put finishes
    drain.cancel()


def test_blocks_round_trip_through_memory_without_redis():
    async def body():
        async with memory_harness("", memory_blocks=8) as h:
            hashes = chain(4, start=11)
            for parent, block_hash in zip([0, *hashes], hashes):
                assert (await h.put("a", block_hash, parent=parent)).status == "stored"
            assert (await h.put("a", hashes[0])).status == "present"
            blocks = await h.get("a", hashes)
            assert [b.payload for b in blocks] == [payload(x) for x in hashes]
            assert [b.parent_hash for b in blocks] == [0, *hashes[:-1]]
            found = await h.store.lookup("a", FP, [*hashes, 5])
            assert found.shared_prefix_blocks == 4
            # another tenant reads neither the blocks nor their presence
            assert await h.get("b", hashes) == []
            targets = [bytearray(PAYLOAD_BYTES) for _ in hashes]
            written = await h.store.get_into("a", FP, hashes, targets)
            assert [bytes(t) for t in targets] == [payload(x) for x in hashes]
            assert [c for _, c in written] == [block_checksum(payload(x)) for x in hashes]
            assert _announced(h) == set(hashes)
            report = await h.store.stats()
            assert report.shared_tier_enabled and report.shared_blocks == 4

    run(body())


def test_a_full_memory_tier_spills_into_redis_and_still_serves(url):
    async def body():
        async with memory_harness(url, memory_blocks=3) as h:
            hashes = chain(6, start=21)
            for block_hash in hashes:
                assert (await h.put("a", block_hash)).status == "stored"
            await _spilled(h)
            # the three oldest went to Redis; all six are served, in order
            blocks = await h.get("a", hashes)
            assert [b.payload for b in blocks] == [payload(x) for x in hashes]
            targets = [bytearray(PAYLOAD_BYTES) for _ in hashes]
            assert len(await h.store.get_into("a", FP, hashes, targets)) == 6
            assert [bytes(t) for t in targets] == [payload(x) for x in hashes]
            assert _announced(h) == set(hashes)  # spilled, not removed
            assert h.ledger.tenants["a"].evictions >= 3

    run(body())


def test_a_full_spill_queue_drops_and_announces_the_removal(url):
    async def body():
        async with memory_harness(url, memory_blocks=2, spill_mb=0) as h:
            hashes = chain(4, start=31)
            for block_hash in hashes:
                await h.put("a", block_hash)
            assert [b.block_hash for b in await h.get("a", hashes[2:])] == hashes[2:]
            assert await h.get("a", hashes[:1]) == []
            assert _announced(h) == set(hashes[2:])

    run(body())


def test_a_tenant_over_its_quota_evicts_only_its_own_blocks():
    async def body():
        async with memory_harness("", memory_blocks=8, quota_blocks=2) as h:
            mine, theirs = chain(3, start=41), chain(2, start=42)
            for block_hash in theirs:
                await h.put("b", block_hash)
            for block_hash in mine:
                assert (await h.put("a", block_hash)).status == "stored"
            assert len(await h.get("b", theirs)) == 2
            assert await h.get("a", mine[:1]) == []
            assert len(await h.get("a", mine[1:])) == 2

    run(body())


def test_leased_blocks_are_not_evicted():
    async def body():
        async with memory_harness("", memory_blocks=2, lease_seconds=30.0) as h:
            hashes = chain(3, start=51)
            await h.put("a", hashes[0])
            await h.put("a", hashes[1])
            await h.store.lookup("a", FP, hashes[:2])  # leases both
            outcome = await h.put("a", hashes[2])
            assert outcome.status == "rejected" and outcome.reason == "capacity"
            assert len(await h.get("a", hashes[:2])) == 2

    run(body())


def test_a_block_changed_in_memory_is_never_returned():
    async def body():
        async with memory_harness("", memory_blocks=4) as h:
            hashes = chain(2, start=61)
            for block_hash in hashes:
                await h.put("a", block_hash)
            memory = h.store.memory
            slot = memory.leading("a", FP, hashes)[1][1].slot
            memory._rows[slot][100] ^= 0xFF  # a bit flipped at rest
            targets = [bytearray(PAYLOAD_BYTES) for _ in hashes]
            assert len(await h.store.get_into("a", FP, hashes, targets)) == 1
            assert h.ledger.tenants["a"].verification_failures == 1
            assert len(await h.get("a", hashes)) == 1  # dropped, not served later
            assert _announced(h) == {hashes[0]}

    run(body())


def test_a_block_of_another_size_goes_to_redis(url):
    async def body():
        async with memory_harness(url, memory_blocks=4) as h:
            small, big = chain(1, start=71)[0], chain(1, start=72)[0]
            await h.put("a", small)
            data = payload(big, 2 * PAYLOAD_BYTES)
            outcome = await h.store.put("a", FP, big, 0, data, block_checksum(data))
            assert outcome.status == "stored"
            assert [b.payload for b in await h.get("a", [big])] == [data]
            assert h.store.memory.usage("a")[0] == 1

    run(body())


def test_a_put_with_a_wrong_checksum_is_rejected_and_stores_nothing():
    async def body():
        async with memory_harness("", memory_blocks=4) as h:
            data = payload(81)
            outcome = await h.store.put("a", FP, 81, 0, data, block_checksum(data) ^ 1)
            assert outcome.status == "rejected" and outcome.reason == "checksum"
            assert await h.get("a", [81]) == []

    run(body())
