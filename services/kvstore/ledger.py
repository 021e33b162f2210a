"""Per-tenant counters of the shared tier (what Stats reports) kept together
with the Prometheus metrics of the same events, so each event is recorded in
one call and the two can never disagree."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from services.common import metrics


@dataclass(slots=True)
class TenantCounters:
    hit_blocks: int = 0
    miss_blocks: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    get_blocks: int = 0
    get_misses: int = 0
    stored_blocks: int = 0
    evictions: int = 0
    verification_failures: int = 0
    rejected_puts: int = 0


class Ledger:
    def __init__(self):
        self.tenants: dict[str, TenantCounters] = defaultdict(TenantCounters)

    def looked_up(self, tenant: str, hits: int, misses: int, block_size: int) -> None:
        c = self.tenants[tenant]
        c.hit_blocks += hits
        c.miss_blocks += misses
        c.hit_tokens += hits * block_size
        c.miss_tokens += misses * block_size
        metrics.KVSTORE_LOOKUP_BLOCKS.labels(tenant=tenant, result="hit").inc(hits)
        metrics.KVSTORE_LOOKUP_BLOCKS.labels(tenant=tenant, result="miss").inc(misses)

    def served(self, tenant: str, blocks: int, misses: int, nbytes: int) -> None:
        c = self.tenants[tenant]
        c.get_blocks += blocks
        c.get_misses += misses
        metrics.KVSTORE_GET_BLOCKS.labels(tenant=tenant, result="hit").inc(blocks)
        metrics.KVSTORE_GET_BLOCKS.labels(tenant=tenant, result="miss").inc(misses)
        metrics.KVSTORE_BYTES.labels(direction="out").inc(nbytes)

    def stored(self, tenant: str, nbytes: int) -> None:
        self.tenants[tenant].stored_blocks += 1
        metrics.KVSTORE_BYTES.labels(direction="in").inc(nbytes)

    def evicted(self, tenant: str, blocks: int, reason: str) -> None:
        if blocks:
            self.tenants[tenant].evictions += blocks
            metrics.KVSTORE_EVICTIONS.labels(tenant=tenant, reason=reason).inc(blocks)

    def verification_failed(self, tenant: str, reason: str) -> None:
        self.tenants[tenant].verification_failures += 1
        metrics.KVSTORE_VERIFICATION_FAILURES.labels(tenant=tenant, reason=reason).inc()

    def rejected(self, tenant: str, reason: str) -> None:
        self.tenants[tenant].rejected_puts += 1
        metrics.KVSTORE_REJECTED_PUTS.labels(tenant=tenant, reason=reason).inc()
