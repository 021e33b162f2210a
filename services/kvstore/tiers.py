"""The KV store's shared tier as its settings make it: Redis (`--redis-url`),
the store's own memory tier in front of it (`--memory-tier-bytes`), or both,
with what the memory tier evicts spilled into Redis. Both announce what they
store and remove as SharedKvEvents; a block leaves the announced set only when
neither tier holds it."""

from __future__ import annotations

import logging

from services.kvstore.block_key import load_key
from services.kvstore.config import KvStoreConfig
from services.kvstore.ledger import Ledger
from services.kvstore.memory_tier import Evicted, MemoryTier
from services.kvstore.quotas import Quotas
from services.kvstore.redis_guard import RedisGuard
from services.kvstore.shared_events import SharedEventLog
from services.kvstore.shared_tier import SharedTier, TierSettings
from services.kvstore.spill import Spiller

logger = logging.getLogger("services.kvstore")


def build_tiers(
    config: KvStoreConfig, ledger: Ledger, events: SharedEventLog
) -> tuple[SharedTier | None, MemoryTier | None, Spiller | None]:
    settings = TierSettings(
        lease_seconds=config.lease_seconds,
        max_lease_seconds=config.max_lease_seconds,
        pending_put_seconds=config.pending_put_seconds,
        public_tenant=config.public_tenant,
    )
    if config.redis_url:  # only Redis holds tagged blocks
        settings.block_key = load_key(config.block_key_file)
    memory: MemoryTier | None = None

    def removed(hashes: list[int]) -> None:
        events.removed([h for h in hashes if memory is None or not memory.holds_hash(h)])

    def on_change(stored: list[int], gone: list[int]) -> None:
        events.stored(stored)
        removed(gone)

    tier = spiller = None
    if config.redis_url:
        quotas = Quotas.load(config.tenant_quotas or None, config.capacity_bytes,
                             config.tenant_quota_bytes)  # fmt: skip
        guard = RedisGuard(config.redis_url, config.redis_cluster, config.redis_timeout)
        tier = SharedTier(guard, quotas, ledger, settings, on_change)
        if config.memory_tier_bytes:
            spiller = Spiller(tier, config.memory_spill_queue_bytes, removed)
    if config.memory_tier_bytes:
        quotas = Quotas.load(config.tenant_quotas or None, config.memory_tier_bytes,
                             config.tenant_quota_bytes)  # fmt: skip

        def on_evict(block: Evicted) -> bool:
            return spiller is not None and spiller.offer(block)

        memory = MemoryTier(config.memory_tier_bytes, quotas, ledger, settings,
                            config.copy_threads, on_change, on_evict)  # fmt: skip
    if tier is None and memory is None:
        logger.warning("no --redis-url and no --memory-tier-bytes: the shared tier is off; "
                       "every Put is refused and every Lookup finds nothing")  # fmt: skip
    return tier, memory, spiller
