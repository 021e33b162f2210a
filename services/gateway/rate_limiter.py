"""Token buckets and concurrency slots per tenant: in this gateway's memory, or in
Redis so that every gateway draws on one budget per tenant.

A bucket holds up to `capacity` and refills at `rate` per second; a request takes 1
from the tenant's request bucket and its tokens from the token bucket (a request
larger than the bucket waits for a full one and empties it; admission refuses
such requests before they get here). A concurrency slot is
held from admission to the request's end; in Redis it is a lease that outlives the
longest request, so slots of a gateway that died free themselves. The check and the
take are one step: atomic in a Lua script, with Redis's clock for every gateway.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from basis.urls import REDIS_PASSWORD_ENV, with_login
from services.gateway.tenant_limits import TenantLimits

logger = logging.getLogger(__name__)
BUSY_RETRY = 1.0  # seconds to wait for a concurrency slot (when one frees is unknown)


@dataclass(slots=True)
class Refusal:
    reason: str
    retry_after: float  # seconds


def _rates(limits: TenantLimits, tokens: int) -> tuple[float, float, float, float, float]:
    """(requests/s, request bucket, tokens/s, token bucket, cost); -1: no limit."""
    rps = limits.requests_per_minute / 60 if limits.requests_per_minute else -1.0
    tps = limits.tokens_per_minute / 60 if limits.tokens_per_minute else -1.0
    cap = limits.tokens_per_minute or 0.0
    return rps, limits.request_bucket, tps, cap, float(min(tokens, cap))


@dataclass(slots=True)
class _Bucket:
    level: float
    at: float

    def refill(self, now: float, rate: float, capacity: float) -> float:
        self.level = min(capacity, self.level + (now - self.at) * rate)
        self.at = now
        return self.level


@dataclass(slots=True)
class LocalLimiter:
    """One gateway's buckets and slots."""

    clock: object = time.monotonic
    buckets: dict[tuple[str, str], _Bucket] = field(default_factory=dict)
    slots: dict[str, set[str]] = field(default_factory=dict)

    def _bucket(self, tenant: str, kind: str, capacity: float, now: float) -> _Bucket:
        return self.buckets.setdefault((tenant, kind), _Bucket(capacity, now))

    async def acquire(
        self, tenant: str, limits: TenantLimits, tokens: int, request_id: str, lease: float
    ) -> Refusal | None:
        now = self.clock()
        rps, rcap, tps, tcap, cost = _rates(limits, tokens)
        waits = []
        if rps > 0:
            level = self._bucket(tenant, "requests", rcap, now).refill(now, rps, rcap)
            if level < 1:
                waits.append(Refusal("requests per minute", (1 - level) / rps))
        if tps > 0:
            level = self._bucket(tenant, "tokens", tcap, now).refill(now, tps, tcap)
            if level < cost:
                waits.append(Refusal("tokens per minute", (cost - level) / tps))
        held = self.slots.setdefault(tenant, set())
        if limits.max_concurrent is not None and len(held) >= limits.max_concurrent:
            waits.append(Refusal("concurrent requests", BUSY_RETRY))
        if waits:
            return max(waits, key=lambda r: r.retry_after)
        if rps > 0:
            self.buckets[(tenant, "requests")].level -= 1
        if tps > 0:
            self.buckets[(tenant, "tokens")].level -= cost
        if limits.max_concurrent is not None:
            held.add(request_id)
        return None

    async def release(self, tenant: str, request_id: str) -> None:
        self.slots.get(tenant, set()).discard(request_id)

    async def close(self) -> None:
        pass


# KEYS: request bucket, token bucket, slots. ARGV: requests/s, request bucket, tokens/s,
# token bucket, cost, max concurrent (-1: none), request id, lease ms.
# Returns {0} when admitted, else {1, reason, retry-after ms}.
_ACQUIRE = """
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function level(key, per_ms, cap)
  local v = redis.call('HMGET', key, 'level', 'at')
  local at = tonumber(v[2]) or now
  return math.min(cap, (tonumber(v[1]) or cap) + (now - at) * per_ms)
end
local function store(key, value, per_ms, cap)
  redis.call('HSET', key, 'level', tostring(value), 'at', now)
  redis.call('PEXPIRE', key, math.ceil(cap / per_ms) + 1000)
end
local rps, rcap = tonumber(ARGV[1]), tonumber(ARGV[2])
local tps, tcap = tonumber(ARGV[3]), tonumber(ARGV[4])
local cost, most = tonumber(ARGV[5]), tonumber(ARGV[6])
local wait, reason, rlevel, tlevel = 0, '', 0, 0
if rps > 0 then
  rlevel = level(KEYS[1], rps / 1000, rcap)
  if rlevel < 1 and (1 - rlevel) / rps * 1000 > wait then
    wait, reason = (1 - rlevel) / rps * 1000, 'requests per minute'
  end
end
if tps > 0 then
  tlevel = level(KEYS[2], tps / 1000, tcap)
  if tlevel < cost and (cost - tlevel) / tps * 1000 > wait then
    wait, reason = (cost - tlevel) / tps * 1000, 'tokens per minute'
  end
end
if most >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= most and wait < 1000 then
    wait, reason = 1000, 'concurrent requests'
  end
end
if wait > 0 then return {1, reason, math.ceil(wait)} end
if rps > 0 then store(KEYS[1], rlevel - 1, rps / 1000, rcap) end
if tps > 0 then store(KEYS[2], tlevel - cost, tps / 1000, tcap) end
if most >= 0 then
  redis.call('ZADD', KEYS[3], now + tonumber(ARGV[8]), ARGV[7])
  redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[8]))
end
return {0}
"""


def _keys(tenant: str) -> list[str]:
    base = f"yinian:ratelimit:{{{tenant}}}"  # one hash slot per tenant (Redis Cluster)
    return [f"{base}:requests", f"{base}:tokens", f"{base}:inflight"]


class RedisLimiter:
    """Buckets and slots in Redis, shared by every gateway that uses it. When Redis
    cannot be reached, this gateway's own buckets stand in (limits per gateway)."""

    def __init__(self, url: str, timeout: float = 0.5):
        import redis.asyncio as redis  # only gateways that share limits need it

        self.client = redis.Redis.from_url(
            with_login(url, REDIS_PASSWORD_ENV),  # a deployment's, from a secret
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
        )
        self.script = self.client.register_script(_ACQUIRE)
        self.fallback = LocalLimiter()
        self.errors = (redis.RedisError, OSError)

    async def acquire(
        self, tenant: str, limits: TenantLimits, tokens: int, request_id: str, lease: float
    ) -> Refusal | None:
        rps, rcap, tps, tcap, cost = _rates(limits, tokens)
        most = -1 if limits.max_concurrent is None else limits.max_concurrent
        args = [rps, rcap, tps, tcap, cost, most, request_id, math.ceil(lease * 1000)]
        try:
            answer = await self.script(keys=_keys(tenant), args=args)
        except self.errors as exc:
            logger.warning("rate limits in Redis unavailable (%s): this gateway's own", exc)
            return await self.fallback.acquire(tenant, limits, tokens, request_id, lease)
        if int(answer[0]) == 0:
            return None
        reason = answer[1].decode() if isinstance(answer[1], bytes) else str(answer[1])
        return Refusal(reason, int(answer[2]) / 1000)

    async def release(self, tenant: str, request_id: str) -> None:
        await self.fallback.release(tenant, request_id)
        try:
            await self.client.zrem(_keys(tenant)[2], request_id)
        except self.errors as exc:
            logger.warning("could not free a concurrency slot in Redis: %s", exc)

    async def close(self) -> None:
        await self.client.aclose()
