"""Tenant limits as buckets: what is admitted, what is refused and for how long,
in one gateway's memory and in Redis (where two gateways draw on one budget)."""

from __future__ import annotations

import asyncio
import json

import pytest
from redis_server import RedisServer

from services.gateway.rate_limiter import LocalLimiter, RedisLimiter
from services.gateway.tenant_limits import TenantLimits, load_limits


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def admitted(limiter, limits, count, tokens=1, tenant="t", start=0):
    async def run():
        return [
            await limiter.acquire(tenant, limits, tokens, f"r{start + i}", 60) for i in range(count)
        ]

    return asyncio.run(run())


def test_request_bucket_refills_at_its_rate():
    clock = Clock()
    limiter = LocalLimiter(clock)
    limits = TenantLimits(requests_per_minute=60, burst=3)
    answers = admitted(limiter, limits, 4)
    assert answers[:3] == [None] * 3
    assert answers[3].reason == "requests per minute"
    assert answers[3].retry_after == pytest.approx(1.0)
    clock.now += 1.0
    assert admitted(limiter, limits, 2, start=10) == [None, answers[3]]
    assert admitted(limiter, limits, 1, tenant="other") == [None]  # buckets are per tenant


def test_token_bucket_counts_tokens_and_caps_a_large_request():
    clock = Clock()
    limiter = LocalLimiter(clock)
    limits = TenantLimits(tokens_per_minute=600)  # 10 tokens/s
    assert admitted(limiter, limits, 1, tokens=400) == [None]
    refused = admitted(limiter, limits, 1, tokens=400, start=1)[0]
    assert refused.reason == "tokens per minute" and refused.retry_after == pytest.approx(20)
    clock.now += 60
    # larger than the bucket: waits for a full bucket, then empties it
    assert admitted(limiter, limits, 1, tokens=10**6, start=2) == [None]
    assert admitted(limiter, limits, 1, tokens=1, start=3)[0].retry_after == pytest.approx(0.1)


def test_concurrency_slots_are_held_until_released():
    limiter = LocalLimiter(Clock())
    limits = TenantLimits(max_concurrent=2)
    answers = admitted(limiter, limits, 3)
    assert answers[:2] == [None, None] and answers[2].reason == "concurrent requests"
    asyncio.run(limiter.release("t", "r0"))
    assert admitted(limiter, limits, 1, start=5) == [None]


def test_two_gateways_share_one_budget_in_redis():
    server = RedisServer().start()

    async def run():
        gateways = [RedisLimiter(server.url), RedisLimiter(server.url)]
        limits = TenantLimits(requests_per_minute=1, burst=5, max_concurrent=4)
        answers = [
            await gateways[i % 2].acquire("shared", limits, 10, f"r{i}", 60) for i in range(7)
        ]
        await gateways[0].release("shared", "r0")
        await gateways[1].release("shared", "r1")
        after = await gateways[1].acquire("shared", limits, 10, "r9", 60)
        for g in gateways:
            await g.close()
        return answers, after

    try:
        answers, after = asyncio.run(run())
    finally:
        server.stop()
    assert answers[:4] == [None] * 4
    assert answers[4].reason == "concurrent requests"  # 4 held, over both gateways
    assert answers[5].reason == answers[6].reason == "concurrent requests"
    assert after is None  # two released; the fifth request of the burst


def test_redis_away_falls_back_to_this_gateways_buckets():
    server = RedisServer().start()
    server.kill()

    async def run():
        limiter = RedisLimiter(server.url, timeout=0.2)
        limits = TenantLimits(requests_per_minute=60, burst=2)
        answers = [await limiter.acquire("t", limits, 1, f"r{i}", 60) for i in range(3)]
        await limiter.close()
        return answers

    answers = asyncio.run(run())
    assert answers[:2] == [None, None] and answers[2].reason == "requests per minute"


def test_limits_file(tmp_path):
    path = tmp_path / "limits.json"
    path.write_text(json.dumps({"*": {"max_concurrent": 3}, "a": {"requests_per_minute": 6}}))
    table = load_limits(str(path))
    assert table.of("a").requests_per_minute == 6 and table.of("b").max_concurrent == 3
    for bad in ({"a": {"requests_per_minute": 0}}, {"a": {"rpm": 5}}, {"a": {"burst": 2}},
                {"a": {"requests_per_minute": True}}, {"a": {"tokens_per_minute": 10**400}},
                {"a": {"requests_per_minute": 60, "burst": 0.5}}):  # fmt: skip
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="'a'"):
            load_limits(str(path))


def test_admission_applies_the_tenants_priority_and_refuses_with_retry_after(tmp_path):
    from basis.sampling_params import SamplingParams
    from services.common.errors import RateLimited
    from services.gateway.admission import Admission
    from services.gateway.frontend import Prepared

    path = tmp_path / "limits.json"
    path.write_text(json.dumps({"batch": {"priority": 10, "requests_per_minute": 60, "burst": 1}}))
    admission = Admission(str(path))

    def prep(priority: int) -> Prepared:
        return Prepared("r", [1, 2, 3], SamplingParams(max_tokens=4), "batch", priority)

    async def run():
        urgent, later = prep(-5), prep(20)
        ticket = await admission.admit("batch", [urgent, later])
        await ticket.release()
        with pytest.raises(RateLimited) as info:
            await admission.admit("batch", [prep(0)])
        return urgent.priority, later.priority, info.value.retry_after

    # lower runs first: a tenant cannot ask for more urgency than its own
    assert asyncio.run(run()) == (10, 20, pytest.approx(1.0, abs=0.1))


def test_a_request_larger_than_the_tenants_token_budget_is_refused_as_too_large(tmp_path):
    from basis.sampling_params import SamplingParams
    from services.common.errors import InvalidRequest
    from services.gateway.admission import Admission
    from services.gateway.frontend import Prepared

    path = tmp_path / "limits.json"
    path.write_text(json.dumps({"t": {"tokens_per_minute": 1000}}))
    admission = Admission(str(path))
    huge = Prepared("r", [1, 2, 3], SamplingParams(max_tokens=500, n=2), "t", 0)
    with pytest.raises(InvalidRequest, match="1003 tokens") as info:
        asyncio.run(admission.admit("t", [huge]))
    assert info.value.param == "max_tokens"
    fits = Prepared("r2", [1, 2, 3], SamplingParams(max_tokens=400, n=2), "t", 0)
    assert asyncio.run(admission.admit("t", [fits])) is not None


def test_retry_after_is_rounded_up_to_whole_seconds():
    from services.common.errors import RateLimited
    from services.gateway.http_guard import error_response

    for wait, header in ((0.2, "1"), (1.2, "2"), (2.5, "3"), (3.0, "3")):
        response = error_response(RateLimited("slow down", retry_after=wait))
        assert (response.status_code, response.headers["retry-after"]) == (429, header)


def test_an_emptied_key_file_keeps_the_keys_in_force(tmp_path):
    from services.common.errors import Unauthenticated
    from services.gateway.auth import Authenticator, load_keys

    path = tmp_path / "keys.txt"
    path.write_text("sk-one alpha\n")
    auth = Authenticator(load_keys(str(path)), str(path))
    for emptied in ("", "# all keys removed\n"):
        path.write_text(emptied)  # an editor's half-written file looks the same
        auth.reload()
        assert auth.enabled
        with pytest.raises(Unauthenticated):
            auth.tenant(None)
        assert auth.tenant("Bearer sk-one") == "alpha"


def test_a_failed_part_of_a_multi_prompt_request_stops_the_others():
    from services.gateway.request_io import gather_or_cancel

    stopped = []

    async def long(i):
        try:
            await asyncio.sleep(30)
        finally:
            stopped.append(i)

    async def failing():
        await asyncio.sleep(0.01)
        raise ValueError("worker lost")

    async def run():
        with pytest.raises(ValueError, match="worker lost"):
            await gather_or_cancel([long(0), failing(), long(1)])
        return sorted(stopped)  # as the error surfaced (before the event loop closes)

    assert asyncio.run(run()) == [0, 1]
