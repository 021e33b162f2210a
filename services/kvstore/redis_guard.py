"""The shared tier's connection to Redis, built to fail fast: short socket
timeouts, one retry (a pooled connection that died with a restarted Redis
reconnects on it), and after a failure a short window in which calls fail at
once instead of each waiting for a timeout. Every call is timed and every
failure counted; when Redis answers again the next call simply works, and
`recovered()` tells the owner once, so it can rebuild what it knew."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from basis.urls import REDIS_PASSWORD_ENV, with_login, without_login
from services.common import metrics

logger = logging.getLogger(__name__)
# Redis did not answer, or the cluster cannot route: every call would fail alike.
_UNREACHABLE = (
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.ClusterError,
    redis_errors.RedisClusterException,
    OSError,
    asyncio.TimeoutError,
)


class TierUnavailable(Exception):
    """Redis did not answer (down, unreachable or too slow)."""


class RedisGuard:
    def __init__(
        self,
        url: str,
        cluster: bool = False,
        timeout: float = 0.5,
        retry_after: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        max_connections: int = 64,
    ):
        options: dict[str, Any] = dict(
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 1),
            decode_responses=False,
        )
        url = with_login(url, REDIS_PASSWORD_ENV)  # a deployment's, from a secret
        if cluster:
            self.client = RedisCluster.from_url(url, **options)
        else:
            # A call waits (up to the timeout) for one of a bounded set of connections,
            # instead of failing at once when a burst of puts has taken them all.
            pool = aioredis.BlockingConnectionPool.from_url(
                url, max_connections=max_connections, timeout=timeout, **options
            )
            self.client = aioredis.Redis(connection_pool=pool)
        self.url = without_login(url)  # what logs say: never its password
        self.timeout = timeout
        self.retry_after = retry_after
        self.clock = clock
        self.errors = 0
        self.recoveries = 0  # times Redis came back after failing
        self.up = True
        self._closed_until = 0.0
        self._recovered = False
        self._latencies: deque[float] = deque(maxlen=1024)
        self._errors_logged: set[str] = set()

    def script(self, lua: str):
        """A script run by EVALSHA (loaded again by itself after a Redis restart)."""
        return self.client.register_script(lua)

    async def call(self, op: str, fn: Callable[..., Awaitable], *args, **kwargs):
        """`await fn(*args, **kwargs)`, or TierUnavailable at once or within the timeout."""
        if not self.up and self.clock() < self._closed_until:
            self._count_failure(op)
            raise TierUnavailable(f"{op}: Redis is down")
        start = time.perf_counter()
        try:
            # Belt and braces: the socket timeouts bound each attempt, this the whole call.
            result = await asyncio.wait_for(fn(*args, **kwargs), timeout=self.timeout * 4)
        except _UNREACHABLE as exc:
            self._count_failure(op)
            if self.up:
                logger.warning("Redis at %s failed (%s: %s); shared tier off until it answers",
                               self.url, type(exc).__name__, exc)  # fmt: skip
            self.up = False
            self._closed_until = self.clock() + self.retry_after
            raise TierUnavailable(f"{op}: {type(exc).__name__}: {exc}") from exc
        except redis_errors.RedisError as exc:
            # Redis answered with an error (out of memory under noeviction, ...):
            # this call fails, the next may not, so the tier stays on.
            self._count_failure(op)
            if type(exc).__name__ not in self._errors_logged:
                self._errors_logged.add(type(exc).__name__)
                logger.warning("Redis at %s refused %s: %s", self.url, op, exc)
            raise TierUnavailable(f"{op}: {type(exc).__name__}: {exc}") from exc
        elapsed = time.perf_counter() - start
        self._latencies.append(elapsed)
        metrics.KVSTORE_REDIS_SECONDS.labels(op=op).observe(elapsed)
        if not self.up:
            logger.info("Redis at %s answers again", self.url)
            self.up = True
            self.recoveries += 1
            self._recovered = True
        return result

    def _count_failure(self, op: str) -> None:
        self.errors += 1
        metrics.KVSTORE_REDIS_ERRORS.labels(op=op).inc()

    async def ping(self) -> bool:
        try:
            await self.call("ping", self.client.ping)
            return True
        except TierUnavailable:
            return False

    def recovered(self) -> bool:
        """True once after Redis came back from a failure."""
        recovered, self._recovered = self._recovered, False
        return recovered

    def latency_ms(self) -> tuple[float, float]:
        """(mean, p99) of the recent round trips, in milliseconds."""
        if not self._latencies:
            return 0.0, 0.0
        ordered = sorted(self._latencies)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        return 1000 * sum(ordered) / len(ordered), 1000 * p99

    async def close(self) -> None:
        try:
            await self.client.aclose()
        except Exception:  # closing a client of a dead server may raise; nothing to do
            pass
