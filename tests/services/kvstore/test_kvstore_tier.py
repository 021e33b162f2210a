"""The shared tier against a real redis-server: what a worker storing and
fetching blocks would notice (round trips, corrupted values never returned,
no half-written block visible, quotas that evict only the tenant's own
blocks, a global capacity, leases that protect but never forever, and a Redis
crash that costs misses, not errors)."""

from __future__ import annotations

import asyncio
import time

import pytest
from kvstore_helpers import (  # noqa: F401 - fixtures
    FP,
    OTHER_FP,
    chain,
    harness,
    payload,
    run,
    server_fixture,
    url_fixture,
    value_bytes,
)
from redis_server import RedisServer, redis_server_binary

from services.kvstore.redis_layout import Namespace, member

pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="no redis-server")


def test_put_get_round_trip(url):
    async def body():
        async with harness(url) as h:
            hashes = chain(3)
            parents = [0, *hashes[:-1]]
            for block_hash, parent in zip(hashes, parents):
                assert (await h.put("a", block_hash, parent=parent)).status == "stored"
            assert (await h.put("a", hashes[0])).status == "present"
            blocks = await h.get("a", hashes)
            assert [b.block_hash for b in blocks] == hashes
            assert [b.parent_hash for b in blocks] == parents
            assert [b.payload for b in blocks] == [payload(x) for x in hashes]
            # Prefix semantics: stops at the first missing block.
            assert len(await h.get("a", [hashes[0], 12345, hashes[2]])) == 1
            # Another fingerprint's blocks are not this one's.
            assert await h.get("a", hashes, fp=OTHER_FP) == []
            found = await h.store.lookup("a", FP, [*hashes, 999])
            assert found.shared_prefix_blocks == 3 and len(found.locations) == 3
            assert all(loc.holders == [("shared", "shared")] for loc in found.locations)
            assert h.ledger.tenants["a"].stored_blocks == 3
            assert h.ledger.tenants["a"].hit_tokens == 3 * FP.block_size

    run(body())


def _flip_payload_byte(value: bytes) -> bytes:
    return value[:-10] + bytes([value[-10] ^ 0x01]) + value[-9:]


def _flip_parent_hash(value: bytes) -> bytes:
    return value[:14] + bytes([value[14] ^ 0x80]) + value[15:]  # inside the parent hash field


@pytest.mark.parametrize(
    "kind,reason",
    [
        ("flipped byte", "checksum"),
        ("truncated", "truncated"),
        ("other fingerprint", "fingerprint"),
        ("flipped parent hash", "header"),
    ],
)
def test_corrupted_values_are_misses(url, server, kind, reason):
    async def body():
        async with harness(url) as h:
            first, second = chain(2, start=7)
            await h.put("a", first)
            raw = server.client()
            key = Namespace("a").block(member(FP.id, second))
            if kind == "other fingerprint":
                await h.put("a", second, fp=OTHER_FP)
                raw.set(key, raw.get(Namespace("a").block(member(OTHER_FP.id, second))))
            else:
                await h.put("a", second)
                value = raw.get(key)
                raw.set(key, {
                    "flipped byte": _flip_payload_byte,
                    "truncated": lambda v: v[: len(v) // 2],
                    "flipped parent hash": _flip_parent_hash,
                }[kind](value))  # fmt: skip
            blocks = await h.get("a", [first, second])
            assert [b.block_hash for b in blocks] == [first]  # the bad one never comes back
            assert h.ledger.tenants["a"].verification_failures == 1
            assert not raw.exists(key), "a value that failed verification is deleted"
            assert (await h.store.lookup("a", FP, [first, second])).shared_prefix_blocks == 1
            # The good block can be stored again, and then it is served.
            assert (await h.put("a", second)).status == "stored"
            assert len(await h.get("a", [first, second])) == 2

    run(body())


def test_half_written_block_is_never_visible(url, server):
    async def body():
        async with harness(url, pending_put_seconds=0.3) as h:
            (block_hash,) = chain(1, start=3)
            # A writer that died between writing and renaming leaves only a temp key.
            raw = server.client()
            temp = Namespace("a").temp(member(FP.id, block_hash), "dead-writer")
            raw.set(temp, b"YNKV" + payload(1)[:100], px=300)
            assert (await h.store.lookup("a", FP, [block_hash])).locations == []
            assert await h.get("a", [block_hash]) == []
            await asyncio.sleep(0.45)
            assert not raw.exists(temp), "a dead writer's half-write expires"
            assert (await h.put("a", block_hash)).status == "stored"
            assert not raw.keys("*:tmp:*"), "a finished put leaves no temp key"
            assert raw.ttl(Namespace("a").block(member(FP.id, block_hash))) == -1

    run(body())


def test_quota_evicts_only_the_tenants_own_lru_blocks(url):
    async def body():
        async with harness(url, overrides={"a": 4 * value_bytes("a")}) as h:
            a, b = chain(6, start=10), chain(3, start=20)
            for x in b:
                await h.put("b", x)
            for x in a[:4]:
                await h.put("a", x)
            # Putting a block again refreshes it (a Get would too, but also lease it).
            assert (await h.put("a", a[0])).status == "present"
            for x in a[4:]:
                assert (await h.put("a", x)).status == "stored"
            held = {x for x in a if await h.get("a", [x])}
            assert held == {a[0], a[3], a[4], a[5]}
            assert len(await h.get("b", b)) == 3, "another tenant's blocks are never evicted"
            assert h.ledger.tenants["a"].evictions == 2 and h.ledger.tenants["b"].evictions == 0
            blocks, nbytes = await h.tier.usage("a")
            assert (blocks, nbytes) == (4, 4 * value_bytes("a"))
            batch = h.events.batches()[0]
            assert batch.reset is False and set(batch.removed) == {a[1], a[2]}

    run(body())


def test_capacity_evicts_the_globally_least_recently_used(url):
    async def body():
        size = value_bytes("a")
        async with harness(url, capacity=5 * size) as h:
            a, b = chain(3, start=30), chain(3, start=40)
            for x in a:
                await h.put("a", x)
                await asyncio.sleep(0.002)  # distinct LRU times
            for x in b:
                assert (await h.put("b", x)).status == "stored"
            assert [x for x in a if await h.get("a", [x])] == a[1:]
            assert (await h.tier.usage("a"))[1] + (await h.tier.usage("b"))[1] <= 5 * size
            assert await h.tier.reconcile() == 5 * size

    run(body())


def test_lookups_in_a_loop_cannot_keep_a_block_forever(url):
    async def body():
        size = value_bytes("a")
        async with harness(url, capacity=2 * size, lease_seconds=0.3, max_lease_seconds=1.0) as h:
            held, (newcomer,) = chain(2, start=50), chain(1, start=60)
            for x in held:
                await h.put("a", x)
            stop = asyncio.Event()

            async def probe():  # a client checking for its prefix, again and again
                while not stop.is_set():
                    await h.store.lookup("a", FP, held)
                    await asyncio.sleep(0.05)

            prober = asyncio.create_task(probe())
            await asyncio.sleep(0.1)
            first_lease = time.monotonic() - 0.1
            outcome = await h.put("a", newcomer)
            assert (outcome.status, outcome.reason) == ("rejected", "capacity")
            while (await h.put("a", newcomer)).status != "stored":
                assert time.monotonic() - first_lease < 3.0, "leases outlived their bound"
                await asyncio.sleep(0.05)
            assert time.monotonic() - first_lease >= 0.9, "evicted before the bound"
            stop.set()
            await prober
            assert h.ledger.tenants["a"].evictions == 1
            assert h.ledger.tenants["a"].rejected_puts >= 1

    run(body())


def test_public_blocks_are_readable_by_every_tenant(url):
    async def body():
        async with harness(url) as h:
            shared, private = chain(2, start=70)
            await h.put("__public__", shared)
            await h.put("a", private)
            assert [b.block_hash for b in await h.get("b", [shared])] == [shared]
            assert (await h.store.lookup("b", FP, [shared, private])).shared_prefix_blocks == 1
            assert await h.get("b", [private]) == []

    run(body())


def test_redis_killed_and_back():
    async def body(server):
        async with harness(server.url) as h:
            hashes = chain(2, start=80)
            assert (await h.put("a", hashes[0])).status == "stored"
            server.kill()
            start = time.monotonic()
            outcome = await h.put("a", hashes[1])
            assert (outcome.status, outcome.reason) == ("rejected", "unavailable")
            assert (await h.store.lookup("a", FP, hashes)).locations == []
            assert await h.get("a", hashes) == []
            stats = await h.store.stats("a")
            assert stats.redis_up is False and stats.tenants[0].counters.rejected_puts == 1
            assert time.monotonic() - start < 2.0, "a dead Redis must fail fast"
            assert h.tier.guard.errors >= 4
            server.start()  # same port, empty: nothing was kept
            deadline = time.monotonic() + 5
            while (await h.put("a", hashes[1])).status != "stored":
                assert time.monotonic() < deadline, "the tier did not come back"
                await asyncio.sleep(0.1)
            assert h.tier.guard.recovered()
            assert [b.block_hash for b in await h.get("a", hashes[1:])] == hashes[1:]
            assert await h.get("a", hashes[:1]) == []  # lost with the old Redis

    with RedisServer() as server:
        run(body(server))


def test_redis_out_of_memory_rejects_puts_but_keeps_serving(url, server):
    async def body():
        raw = server.client()
        async with harness(url) as h:
            try:
                kept, refused = chain(2, start=90)
                await h.put("a", kept)
                raw.config_set("maxmemory-policy", "noeviction")
                # full, whatever it holds now: a limit a Redis of used_memory + 1 KiB once
                # met with room to spare (its used memory had shrunk since it was read)
                raw.config_set("maxmemory", 1)
                outcome = await h.put("a", refused)
                assert (outcome.status, outcome.reason) == ("rejected", "unavailable")
                assert "OutOfMemory" in outcome.detail or "OOM" in outcome.detail
                assert h.tier.guard.up, "an answering Redis is not a dead one"
                assert [b.block_hash for b in await h.get("a", [kept])] == [kept]
            finally:
                raw.config_set("maxmemory", 0)

    run(body())
