"""Admission of a checked request by its tenant's limits (tenant_limits.py), on the
buckets of rate_limiter.py: a RateLimited error (429 + Retry-After) before anything
runs, or a ticket that holds the tenant's concurrency slot until the request ends.
The tenant's priority is applied here too, on its way to the engine."""

from __future__ import annotations

import logging

from services.common import metrics
from services.common.errors import InvalidRequest, RateLimited
from services.gateway.frontend import Prepared
from services.gateway.rate_limiter import LocalLimiter, RedisLimiter
from services.gateway.tenant_limits import LimitTable, load_limits

logger = logging.getLogger(__name__)


class Ticket:
    """An admitted request's hold on its tenant's concurrency slot."""

    def __init__(self, admission: Admission | None, tenant: str, request_id: str):
        self._admission = admission
        self.tenant = tenant
        self.request_id = request_id

    async def release(self) -> None:
        admission, self._admission = self._admission, None  # once, however it ends
        if admission is not None:
            await admission.limiter.release(self.tenant, self.request_id)


class Admission:
    def __init__(self, limits_path: str | None = None, redis_url: str = "", lease: float = 630):
        self.limits_path = limits_path
        self.table: LimitTable = load_limits(limits_path)
        self.limiter = RedisLimiter(redis_url) if redis_url else LocalLimiter()
        self.lease = lease  # a concurrency slot's life in Redis: past the longest request

    def reload(self) -> None:
        """Reads the limits file again; a broken file keeps the limits in force."""
        try:
            self.table = load_limits(self.limits_path)
        except ValueError as exc:
            logger.error("tenant limits not reloaded: %s", exc)

    async def admit(self, tenant: str, preps: list[Prepared]) -> Ticket:
        limits = self.table.of(tenant)
        if limits.priority is not None:
            for prep in preps:
                prep.priority = max(prep.priority, limits.priority)
        if not limits.limited:
            return Ticket(None, tenant, "")
        tokens = sum(len(p.prompt_ids) + p.params.max_tokens * p.params.n for p in preps)
        if limits.tokens_per_minute is not None and tokens > limits.tokens_per_minute:
            # it could never fit the bucket: waiting would not help
            raise InvalidRequest(
                f"the request needs {tokens} tokens (prompt + max_tokens x n), more than "
                f"the tenant's limit of {limits.tokens_per_minute:g} tokens per minute; "
                "lower max_tokens or n",
                param="max_tokens",
            )
        request_id = preps[0].request_id
        refusal = await self.limiter.acquire(tenant, limits, tokens, request_id, self.lease)
        if refusal is not None:
            metrics.RATE_LIMITED.labels(reason=refusal.reason).inc()
            raise RateLimited(
                f"Rate limit reached for {refusal.reason}: retry after {refusal.retry_after:.1f} s",
                retry_after=refusal.retry_after,
            )
        return Ticket(self, tenant, request_id)

    async def close(self) -> None:
        await self.limiter.close()
