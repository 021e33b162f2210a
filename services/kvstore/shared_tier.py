"""The shared tier: whole KV blocks in Redis, per tenant and model fingerprint.

Puts are two-phase (the value is written under a temporary key with a TTL,
then renamed into place by a script that also charges the tenant), so no
reader ever sees half a block and a dead writer's half-write expires. Reads
verify every header field and the checksum; a value that fails is dropped,
counted and never returned. Eviction is LRU: a tenant over its quota evicts
its own blocks, a full tier evicts the globally least recently used; leased
blocks are skipped. Every Redis failure becomes a miss or a rejected put.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from services.kvstore import redis_layout as layout
from services.kvstore.block_format import Block, BlockCorrupt, decode, encode
from services.kvstore.block_key import random_key
from services.kvstore.fingerprint import Fingerprint
from services.kvstore.ledger import Ledger
from services.kvstore.quotas import Quotas
from services.kvstore.redis_guard import RedisGuard, TierUnavailable
from services.kvstore.redis_layout import Namespace, member, parse_member

logger = logging.getLogger(__name__)
_LOGGED_KEYS_MAX = 10_000


@dataclass(slots=True)
class TierSettings:
    lease_seconds: float = 10.0
    max_lease_seconds: float = 30.0
    pending_put_seconds: float = 30.0
    public_tenant: str = "__public__"
    scan_limit: int = 4096  # blocks an eviction looks at before it gives up
    # tags the blocks in Redis (block_key.py); a random one unless the mesh gives one
    block_key: bytes = field(default_factory=random_key)


@dataclass(slots=True)
class PutOutcome:
    status: str  # "stored" | "present" | "rejected"
    reason: str = ""  # a short code for metrics ("quota", "capacity", ...)
    detail: str = ""


def readable(settings: TierSettings, tenant: str) -> list[str]:
    """The namespaces a tenant reads (in Redis and the memory tier alike): its own,
    then the public one."""
    public = settings.public_tenant
    return [tenant] if tenant == public else [tenant, public]


def _rejected(reason: str, detail: str) -> PutOutcome:
    return PutOutcome("rejected", reason, detail)


class SharedTier:
    def __init__(
        self,
        guard: RedisGuard,
        quotas: Quotas,
        ledger: Ledger,
        settings: TierSettings,
        on_change: Callable[[list[int], list[int]], None] = lambda stored, removed: None,
    ):
        self.guard, self.quotas, self.ledger, self.settings = guard, quotas, ledger, settings
        self.on_change = on_change
        self.r = guard.client
        self._commit = guard.script(layout.COMMIT)
        self._present = guard.script(layout.PRESENT)
        self._lease = guard.script(layout.LEASE)
        self._evict = guard.script(layout.EVICT)
        self._oldest = guard.script(layout.OLDEST)
        self._drop = guard.script(layout.DROP)
        # Tenants and fingerprints written to Redis, valid until Redis fails
        # (it may come back empty).
        self._registered: set[tuple[str, str]] = set()
        self._registered_at = guard.recoveries
        self._logged: set[str] = set()

    @property
    def capacity(self) -> int:
        return self.quotas.capacity

    def readable(self, tenant: str) -> list[str]:
        return readable(self.settings, tenant)

    @staticmethod
    def _now_ms() -> int:
        return int(time.time() * 1000)

    async def _call(self, op: str, fn, *args, **kwargs):
        return await self.guard.call(op, fn, *args, **kwargs)

    # -- writes ----------------------------------------------------------------
    async def put(
        self,
        tenant: str,
        fingerprint: Fingerprint,
        block_hash: int,
        parent_hash: int,
        payload: bytes,
        checksum: int,
    ) -> PutOutcome:
        """Stores one block whose checksum the caller has verified."""
        ns, m = Namespace(tenant), member(fingerprint.id, block_hash)
        value = encode(fingerprint.canonical(), tenant, block_hash, parent_hash, checksum, payload,
                       key=self.settings.block_key)  # fmt: skip
        quota = self.quotas.for_tenant(tenant)
        if len(value) > quota:
            return _rejected("too_large", f"{len(value)} bytes exceed the quota of {quota}")
        try:
            await self._register(tenant, fingerprint)
            if await self._call("exists", self.r.exists, ns.block(m)):
                await self._call("touch", self.r.zadd, ns.lru, {m: self._now_ms()}, xx=True)
                return PutOutcome("present")
            if not await self._make_room(len(value)):
                return _rejected("capacity", "the shared tier is full of leased blocks")
            temp = ns.temp(m, uuid.uuid4().hex[:12])
            pending_ms = max(1, int(self.settings.pending_put_seconds * 1000))
            await self._call("write", self.r.set, temp, value, px=pending_ms)
            status, freed, evicted = await self._call(
                "commit",
                self._commit,
                keys=[temp, ns.block(m), *ns.accounting],
                args=[ns.prefix, m, len(value), self._now_ms(), quota, self.settings.scan_limit],
            )
        except TierUnavailable as exc:
            return _rejected("unavailable", f"shared tier unavailable ({exc})")
        status = status.decode()
        await self._evicted(tenant, evicted, freed, "quota")
        if status == "present":
            return PutOutcome("present")
        if status == "expired":
            return _rejected("expired", "the put took longer than --pending-put-seconds")
        if status == "quota":
            return _rejected("quota", f"tenant over its quota of {quota} bytes (blocks leased)")
        await self._adjust_total(len(value))
        self.on_change([block_hash], [])
        return PutOutcome("stored")

    async def _register(self, tenant: str, fingerprint: Fingerprint) -> None:
        if self._registered_at != self.guard.recoveries:
            self._registered.clear()
            self._registered_at = self.guard.recoveries
        key = (tenant, fingerprint.id)
        if key in self._registered:
            return
        await self._call("register", self.r.sadd, layout.TENANTS_KEY, tenant)
        await self._call(
            "register",
            self.r.hsetnx,
            layout.FINGERPRINTS_KEY,
            fingerprint.id,
            fingerprint.canonical(),
        )
        self._registered.add(key)

    async def _adjust_total(self, delta: int) -> None:
        if delta:
            try:
                await self._call("total", self.r.incrby, layout.TOTAL_KEY, delta)
            except TierUnavailable:
                pass  # reconcile() recomputes the total from the tenants' usage

    async def _evicted(self, tenant: str, members, freed: int, reason: str) -> None:
        if not members:
            return
        self.ledger.evicted(tenant, len(members), reason)
        self.on_change([], [parse_member(m)[1] for m in members])
        await self._adjust_total(-int(freed))

    async def _make_room(self, need: int) -> bool:
        """Evicts the globally least recently used unleased blocks until `need`
        more bytes fit in the capacity; False when leases forbid it."""
        total = int(await self._call("total", self.r.get, layout.TOTAL_KEY) or 0)
        excess = total + need - self.capacity
        for _ in range(64):
            if excess <= 0:
                return True
            now = self._now_ms()
            oldest = []
            for tenant in await self.tenants():
                ns = Namespace(tenant)
                score = await self._call(
                    "oldest", self._oldest, keys=[ns.lru, ns.lease], args=[now, 1024]
                )
                if score >= 0:
                    oldest.append((score, tenant))
            if not oldest:
                return False
            oldest.sort()
            # Evict from the tenant with the oldest block, down to the next tenant's oldest.
            bound = oldest[1][0] if len(oldest) > 1 else layout.NO_SCORE_LIMIT
            tenant = oldest[0][1]
            ns = Namespace(tenant)
            freed, members = await self._call(
                "evict",
                self._evict,
                keys=ns.accounting,
                args=[ns.prefix, now, excess, bound, self.settings.scan_limit],
            )
            if not members:
                return False
            await self._evicted(tenant, members, freed, "capacity")
            excess -= freed
        return excess <= 0

    # -- reads -----------------------------------------------------------------
    async def present(self, tenant: str, fingerprint: Fingerprint, hashes) -> list[str | None]:
        """For each hash, the namespace holding it (the tenant's before the
        public one), or None; all None when Redis is down."""
        owners: list[str | None] = [None] * len(hashes)
        try:
            for owner in self.readable(tenant):
                missing = [i for i, o in enumerate(owners) if o is None]
                if not missing:
                    break
                ns = Namespace(owner)
                members = [member(fingerprint.id, hashes[i]) for i in missing]
                flags = await self._call(
                    "present", self._present, keys=[ns.lru], args=[ns.prefix, *members]
                )
                for i, found in zip(missing, flags):
                    if found:
                        owners[i] = owner
        except TierUnavailable:
            return [None] * len(hashes)
        return owners

    async def lease(self, fingerprint: Fingerprint, hashes, owners) -> None:
        """Read leases (and an LRU touch) on blocks about to be read."""
        s = self.settings
        by_owner: dict[str, list[str]] = {}
        for h, owner in zip(hashes, owners):
            if owner is not None:
                by_owner.setdefault(owner, []).append(member(fingerprint.id, h))
        args = [self._now_ms(), int(s.lease_seconds * 1000), int(s.max_lease_seconds * 1000)]
        for owner, members in by_owner.items():
            ns = Namespace(owner)
            try:
                await self._call(
                    "lease", self._lease, keys=[ns.lru, ns.lease], args=[*args, *members]
                )
            except TierUnavailable:
                return

    async def read(self, owner: str, fingerprint: Fingerprint, block_hash: int) -> Block | None:
        """The verified block, or None (missing, failed verification, Redis down)."""
        ns, m = Namespace(owner), member(fingerprint.id, block_hash)
        try:
            value = await self._call("get", self.r.get, ns.block(m))
        except TierUnavailable:
            return None
        if value is None:
            await self.drop(owner, m)  # gone behind our back (Redis's own eviction?)
            return None
        try:
            return decode(value, fingerprint=fingerprint.canonical(), tenant=owner,
                          block_hash=block_hash, key=self.settings.block_key)  # fmt: skip
        except BlockCorrupt as exc:
            self.ledger.verification_failed(owner, exc.reason)
            key = ns.block(m)
            if key not in self._logged:
                if len(self._logged) >= _LOGGED_KEYS_MAX:
                    self._logged.clear()
                self._logged.add(key)
                logger.warning("dropping %s: failed verification (%s)", key, exc)
            await self.drop(owner, m)
            return None

    async def drop(self, owner: str, m: str) -> None:
        ns = Namespace(owner)
        try:
            freed = await self._call("drop", self._drop, keys=ns.accounting, args=[ns.prefix, m])
            # The value may not be accounted (written by hand): delete it regardless.
            await self._call("drop", self.r.delete, ns.block(m))
        except TierUnavailable:
            return
        if freed:
            self.on_change([], [parse_member(m)[1]])
            await self._adjust_total(-int(freed))

    # -- totals ----------------------------------------------------------------
    async def tenants(self) -> list[str]:
        names = await self._call("tenants", self.r.smembers, layout.TENANTS_KEY)
        return sorted(n.decode() for n in names)

    async def usage(self, tenant: str) -> tuple[int, int]:
        """(blocks, bytes) the tenant holds."""
        ns = Namespace(tenant)
        blocks = await self._call("usage", self.r.zcard, ns.lru)
        nbytes = await self._call("usage", self.r.get, ns.usage)
        return int(blocks), int(nbytes or 0)

    async def snapshot(self) -> list[int]:
        """Every block hash in the tier, of every tenant and fingerprint."""
        hashes: list[int] = []
        for tenant in await self.tenants():
            members = await self._call("snapshot", self.r.zrange, Namespace(tenant).lru, 0, -1)
            hashes += [parse_member(m)[1] for m in members]
        return hashes

    async def reconcile(self) -> int:
        """Recomputes the tier's total from the tenants' usage (after a restart
        of either side, or a total update lost to a failure); returns it."""
        total = 0
        for tenant in await self.tenants():
            total += (await self.usage(tenant))[1]
        await self._call("total", self.r.set, layout.TOTAL_KEY, total)
        return total
