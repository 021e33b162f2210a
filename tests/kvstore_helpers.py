"""Building a KV store core over a real Redis for tests, and blocks to put in it."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import pytest
from redis_server import RedisServer

from services.common.kv_checksum import block_checksum
from services.kvstore.block_format import encode
from services.kvstore.fingerprint import Fingerprint
from services.kvstore.ledger import Ledger
from services.kvstore.quotas import Quotas
from services.kvstore.redis_guard import RedisGuard
from services.kvstore.shared_events import SharedEventLog
from services.kvstore.shared_tier import SharedTier, TierSettings
from services.kvstore.store import KvStore

FP = Fingerprint("tiny-llama", "float32", 16, "2x16x4x8", 2, 1)
OTHER_FP = Fingerprint("tiny-llama", "bfloat16", 16, "2x16x4x8", 2, 1)
PAYLOAD_BYTES = 4096


# an engine whose host tier writes to the store (small: its blocks leave the device)
ENGINE = dict(device="cpu", dtype="float32", host_kv_cache_gb=0.05, max_num_seqs=16)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 480) for _ in range(length)] for _ in range(n)]


def payload(seed: int, size: int = PAYLOAD_BYTES) -> bytes:
    return random.Random(seed).randbytes(size)


def chain(n: int, start: int = 1) -> list[int]:
    """n chained block hashes (any distinct 64-bit values do for the store)."""
    rng = random.Random(start)
    return [rng.getrandbits(64) for _ in range(n)]


def value_bytes(tenant: str, fingerprint: Fingerprint = FP, size: int = PAYLOAD_BYTES) -> int:
    """What one block of `size` payload bytes costs in Redis (header included)."""
    return len(encode(fingerprint.canonical(), tenant, 1, 0, 0, b"\0" * size, key=bytes(32)))


@dataclass
class Harness:
    store: KvStore
    tier: SharedTier
    ledger: Ledger
    events: SharedEventLog
    seen: list = field(default_factory=list)
    spiller: object = None

    async def put(self, tenant: str, h: int, seed: int | None = None, parent: int = 0, fp=FP):
        data = payload(h if seed is None else seed)
        return await self.store.put(tenant, fp, h, parent, data, block_checksum(data))

    async def get(self, tenant: str, hashes, fp=FP) -> list:
        return [b async for b in self.store.get(tenant, fp, hashes)]

    async def close(self) -> None:
        if self.tier is not None:
            await self.tier.guard.close()
        if self.store.memory is not None:
            self.store.memory.close()

    async def __aenter__(self) -> Harness:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def harness(
    url: str,
    capacity: int = 1 << 24,
    quota: int = 0,
    overrides: dict | None = None,
    cluster: bool = False,
    **settings,
) -> Harness:
    ledger, events = Ledger(), SharedEventLog()
    guard = RedisGuard(url, cluster, timeout=0.5, retry_after=0.3)

    def on_change(stored, removed):
        events.stored(stored)
        events.removed(removed)

    tier = SharedTier(
        guard, Quotas(capacity, quota, overrides or {}), ledger, TierSettings(**settings), on_change
    )
    return Harness(KvStore(tier, ledger), tier, ledger, events)


def memory_harness(url: str, memory_blocks: int, quota_blocks: int = 0, spill_mb: int = 64,
                   **settings) -> Harness:  # fmt: skip
    """A store whose memory tier holds `memory_blocks` blocks of PAYLOAD_BYTES in
    front of Redis (url; "" for none), wired as the KV store service wires it."""
    from services.kvstore.config import KvStoreConfig
    from services.kvstore.tiers import build_tiers

    config = KvStoreConfig(
        redis_url=url, memory_tier_bytes=memory_blocks * PAYLOAD_BYTES, copy_threads=2,
        tenant_quota_bytes=quota_blocks * PAYLOAD_BYTES, memory_spill_queue_bytes=spill_mb << 20,
        **settings,
    )  # fmt: skip
    ledger, events = Ledger(), SharedEventLog()
    tier, memory, spiller = build_tiers(config, ledger, events)
    h = Harness(KvStore(tier, ledger, memory=memory), tier, ledger, events)
    h.spiller = spiller
    return h


@pytest.fixture(scope="module", name="server")
def server_fixture():
    """One redis-server for a test module (a module imports it with `url_fixture`)."""
    with RedisServer() as s:
        yield s


@pytest.fixture(name="url")
def url_fixture(server):
    """The module's Redis, emptied for each test."""
    server.client().flushall()
    return server.url


def run(coro):
    return asyncio.run(coro)
