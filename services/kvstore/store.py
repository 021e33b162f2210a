"""The KV store's operations, free of gRPC: Lookup over the shared tier, Put,
Get and Stats. Every request is checked before any state changes (a bad one
raises InvalidRequest); with no shared tier configured, Lookup finds nothing
and Put rejects."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from services.common import metrics
from services.common.errors import InvalidRequest
from services.common.kv_checksum import block_checksum
from services.common.kv_index import SHARED, SHARED_HOLDER, check_block_count
from services.kvstore.block_format import Block
from services.kvstore.fingerprint import Fingerprint
from services.kvstore.ledger import Ledger, TenantCounters
from services.kvstore.memory_tier import LEND_SECONDS, MemoryTier
from services.kvstore.redis_guard import TierUnavailable
from services.kvstore.shared_tier import PutOutcome, SharedTier

MAX_TENANT_CHARS = 256


@dataclass(slots=True)
class Location:
    block_hash: int
    holders: list[tuple[str, str]]  # (holder, tier): a worker's GPU/host, or ("shared", "shared")


@dataclass(slots=True)
class LookupResult:
    locations: list[Location]
    shared_prefix_blocks: int


@dataclass(slots=True)
class Lent:
    """Where the leading blocks lie in the memory tier's shared region, lent."""

    region: tuple[str, int] | None  # (path, size); None: nothing can be lent here
    slot_bytes: int = 0
    blocks: list[tuple[int, int, int]] = field(default_factory=list)  # (offset, parent, checksum)
    seconds: float = 0.0  # how long each stays put


@dataclass(slots=True)
class TenantReport:
    tenant: str
    blocks: int
    bytes: int
    quota_bytes: int
    counters: TenantCounters


@dataclass(slots=True)
class StatsReport:
    tenants: list[TenantReport]
    shared_tier_enabled: bool
    redis_up: bool = False
    shared_blocks: int = 0
    shared_bytes: int = 0
    capacity_bytes: int = 0
    redis_errors: int = 0
    redis_latency_ms: tuple[float, float] = (0.0, 0.0)


def check_tenant(tenant: str) -> None:
    if len(tenant) > MAX_TENANT_CHARS:
        raise InvalidRequest(f"tenant is longer than {MAX_TENANT_CHARS} characters")


class KvStore:
    def __init__(
        self,
        tier: SharedTier | None,
        ledger: Ledger,
        max_block_bytes: int = 64 << 20,
        memory: MemoryTier | None = None,
    ):
        self.tier, self.ledger = tier, ledger
        self.max_block_bytes = max_block_bytes
        self.memory = memory

    @property
    def shared(self) -> bool:
        """Whether there is a shared tier (the memory tier, Redis or both)."""
        return self.tier is not None or self.memory is not None

    async def _owners(self, tenant: str, fingerprint: Fingerprint, hashes: list[int]):
        """For each hash, the namespace holding it in the memory tier and in Redis
        (looked up there only for what memory lacks)."""
        none: list[str | None] = [None] * len(hashes)
        mem = self.memory.present(tenant, fingerprint, hashes) if self.memory else none
        red = list(none)
        missing = [i for i, o in enumerate(mem) if o is None]
        if self.tier is not None and missing:
            found = await self.tier.present(tenant, fingerprint, [hashes[i] for i in missing])
            for i, owner in zip(missing, found):
                red[i] = owner
        return mem, red

    async def _lease(self, fingerprint: Fingerprint, hashes, mem, red) -> None:
        if self.memory is not None:
            self.memory.lease(fingerprint, hashes, mem)
        if self.tier is not None:
            await self.tier.lease(fingerprint, hashes, red)

    async def lookup(self, tenant: str, fingerprint: Fingerprint, hashes) -> LookupResult:
        check_tenant(tenant)
        check_block_count(hashes)
        hashes = list(hashes)
        mem, red = await self._owners(tenant, fingerprint, hashes)
        locations = []
        for i, h in enumerate(hashes):  # the shared tier's leading blocks
            if mem[i] is None and red[i] is None:
                break
            locations.append(Location(h, [(SHARED_HOLDER, SHARED)]))
        shared_prefix = len(locations)
        if self.shared:
            n = shared_prefix  # the blocks it reports: leased
            await self._lease(fingerprint, hashes[:n], mem[:n], red[:n])
            self.ledger.looked_up(
                tenant, shared_prefix, len(hashes) - shared_prefix, fingerprint.block_size
            )
        return LookupResult(locations, shared_prefix)

    def check_put(self, tenant: str, data: bytes) -> None:
        check_tenant(tenant)
        if not data:
            raise InvalidRequest("a block needs data")
        if len(data) > self.max_block_bytes:
            raise InvalidRequest(
                f"block of {len(data)} bytes; at most {self.max_block_bytes} (--max-block-bytes)"
            )

    async def put(
        self,
        tenant: str,
        fingerprint: Fingerprint,
        block_hash: int,
        parent_hash: int,
        data: bytes,
        checksum: int,
    ) -> PutOutcome:
        """Stores one whole block; the outcome says stored, present or rejected (and why)."""
        self.check_put(tenant, data)
        if block_checksum(data) != checksum:
            outcome = PutOutcome("rejected", "checksum", "checksum mismatch: corrupted in transit")
        elif self.memory is not None and self.memory.takes(len(data)):
            [outcome] = await self.memory.put(
                tenant, fingerprint, [(block_hash, parent_hash, data)], [checksum]
            )
        elif self.tier is None:
            outcome = PutOutcome(
                "rejected", "disabled", "no shared tier (--redis-url and --memory-tier-bytes unset)"
            )
        else:
            outcome = await self.tier.put(
                tenant, fingerprint, block_hash, parent_hash, data, checksum
            )
        self._account(tenant, outcome, len(data))
        return outcome

    def _account(self, tenant: str, outcome: PutOutcome, nbytes: int) -> None:
        if outcome.status == "rejected":
            self.ledger.rejected(tenant, outcome.reason)
        elif outcome.status == "stored":
            self.ledger.stored(tenant, nbytes)

    async def put_views(
        self, tenant: str, fingerprint: Fingerprint, blocks: list[tuple[int, int, memoryview]]
    ) -> list[PutOutcome]:
        """Stores (hash, parent, bytes) blocks read from memory the store trusts to
        hold still (a worker's pinned host-tier slots): into the memory tier in one
        threaded copy where it takes them, else one by one, checksummed here."""
        mem = self.memory
        if mem is None or not blocks or not all(mem.takes(len(b[2])) for b in blocks):
            return [await self.put(tenant, fingerprint, h, p, d, block_checksum(d))
                    for h, p, d in blocks]  # fmt: skip
        for _, _, data in blocks:
            self.check_put(tenant, data)
        outcomes = await mem.put(tenant, fingerprint, blocks)
        for (_, _, data), outcome in zip(blocks, outcomes):
            self._account(tenant, outcome, len(data))
        return outcomes

    async def get_into(
        self, tenant: str, fingerprint: Fingerprint, hashes: list[int], targets, late=lambda: False
    ) -> list[tuple[int, int]]:
        """Writes the leading blocks the shared tier serves into `targets` (writable
        buffers, one per hash): the memory tier's in one threaded copy, then Redis's
        while `late()` is false; (parent hash, checksum) of each block written."""
        check_tenant(tenant)
        check_block_count(hashes)
        out: list[tuple[int, int]] = []
        mem = self.memory
        if mem is not None and targets and len(targets[0]) == mem.slot_bytes:
            entries = mem.leading(tenant, fingerprint, hashes)
            mem.lease(fingerprint, hashes[: len(entries)], [key[0] for key, _ in entries])
            n = await mem.read_into(entries, targets[: len(entries)])
            out = [(entry.parent, entry.checksum) for _, entry in entries[:n]]
            if n < len(entries) or n == len(hashes) or self.tier is None or late():
                self.ledger.served(tenant, n, len(hashes) - n, n * mem.slot_bytes)
                return out
            self.ledger.served(tenant, n, 0, n * mem.slot_bytes)
        if self.tier is None:
            return out
        done = len(out)
        async with aclosing(self.get(tenant, fingerprint, hashes[done:])) as blocks:
            async for block in blocks:
                target = targets[len(out)]
                if len(block.payload) != len(target) or late():
                    break  # another layout's block under this fingerprint (a miss), or late
                target[:] = block.payload
                out.append((block.parent_hash, block.checksum))
        return out

    async def lend(
        self, tenant: str, fingerprint: Fingerprint, block_bytes: int, hashes: list[int]
    ) -> Lent:
        """The memory tier's leading blocks of `hashes`, for a worker on this host to
        copy out of the shared region itself (and verify); with no hashes, only the
        region (a worker mapping it ahead of any block)."""
        check_tenant(tenant)
        check_block_count(hashes)
        if block_bytes <= 0 or block_bytes > self.max_block_bytes:
            raise InvalidRequest(
                f"block_bytes {block_bytes}; at most {self.max_block_bytes} (--max-block-bytes)"
            )
        mem = self.memory
        if mem is None:
            return Lent(None)
        entries = await mem.lend(tenant, fingerprint, hashes, block_bytes)
        if mem.region is None or mem.slot_bytes != block_bytes:
            return Lent(None)
        if entries:  # what it could not lend, the worker may still get (GetInto, Redis)
            self.ledger.served(tenant, len(entries), 0, len(entries) * block_bytes)
        blocks = [(offset, e.parent, e.checksum) for offset, e in entries]
        return Lent(mem.region, mem.slot_bytes, blocks, LEND_SECONDS)

    async def get(self, tenant: str, fingerprint: Fingerprint, hashes) -> AsyncIterator[Block]:
        """The leading blocks the shared tier can serve, verified, in order."""
        check_tenant(tenant)
        check_block_count(hashes)
        hashes = list(hashes)
        served = nbytes = 0
        try:
            if not self.shared:
                return
            mem, red = await self._owners(tenant, fingerprint, hashes)
            n = next((i for i, o in enumerate(zip(mem, red)) if o == (None, None)), len(hashes))
            await self._lease(fingerprint, hashes[:n], mem[:n], red[:n])
            for h, in_memory, in_redis in zip(hashes[:n], mem, red):
                if in_memory is not None:
                    block = self.memory.block(in_memory, fingerprint, h)
                else:
                    block = await self.tier.read(in_redis, fingerprint, h)
                if block is None:
                    return
                served += 1
                nbytes += len(block.payload)
                yield block
        finally:
            self.ledger.served(tenant, served, len(hashes) - served, nbytes)

    async def stats(self, tenant: str | None = None) -> StatsReport:
        report = StatsReport([], self.shared)
        if tenant is not None:
            check_tenant(tenant)
        names = set(self.ledger.tenants) if tenant is None else {tenant}
        if self.tier is not None:
            tier = self.tier
            report.capacity_bytes = tier.capacity
            report.redis_errors = tier.guard.errors
            report.redis_latency_ms = tier.guard.latency_ms()
            usage: dict[str, tuple[int, int]] = {}
            try:
                known = await tier.tenants()
                for name in known:
                    usage[name] = await tier.usage(name)
                report.redis_up = True
            except TierUnavailable:  # report the counters, which need no Redis
                known = []
            report.shared_blocks = sum(b for b, _ in usage.values())
            report.shared_bytes = sum(n for _, n in usage.values())
            if tenant is None:
                names |= set(known)
        mem = self.memory
        if mem is not None:
            report.capacity_bytes += mem.capacity
            for name in mem.tenants():
                blocks, nbytes = mem.usage(name)
                report.shared_blocks += blocks
                report.shared_bytes += nbytes
                if tenant is None:
                    names.add(name)
        for name in sorted(names):
            blocks, nbytes = usage.get(name, (0, 0)) if self.tier else (0, 0)
            if mem is not None:
                in_memory = mem.usage(name)
                blocks, nbytes = blocks + in_memory[0], nbytes + in_memory[1]
            quota = self.tier.quotas.for_tenant(name) if self.tier else 0
            counters = self.ledger.tenants.get(name) or TenantCounters()
            report.tenants.append(TenantReport(name, blocks, nbytes, quota, counters))
        return report

    async def refresh_gauges(self) -> None:
        """Sets the quota-use gauges (the app calls it now and then)."""
        if self.tier is None:
            return
        try:
            for name in await self.tier.tenants():
                metrics.KVSTORE_TENANT_BYTES.labels(tenant=name).set(
                    (await self.tier.usage(name))[1]
                )
                metrics.KVSTORE_TENANT_QUOTA.labels(tenant=name).set(
                    self.tier.quotas.for_tenant(name)
                )
        except TierUnavailable:
            pass
