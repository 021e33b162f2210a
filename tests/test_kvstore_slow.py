"""A slow KV store does not slow the engine: with every byte to and from the
store 100 ms late (a delaying proxy in front of a real `python -m
services.kvstore` on Redis), a worker's shared-tier reads and writes run
beside 8 decoding requests, and the engine's steps follow each other as
quickly as with no store activity at all (median time from one step's start
to the next's), none of them ever waiting a round trip to the store; every
request ends with its whole output."""

from __future__ import annotations

import asyncio
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvstore_process import KvStoreProcess
from redis_server import RedisServer, redis_server_binary

from engine import AsyncLLM, SamplingParams
from services.common.kvstore_client import KvStoreClient
from services.common.processes import free_port, start_nats, stop_process
from services.common.shared_kv import SharedKv
from services.common.worker_host import model_fingerprint

pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="no redis-server")
DELAY = 0.1
DECODE = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", host_kv_cache_gb=0.05, max_num_seqs=16)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 480) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module")
def slow_store():
    nats_proc, nats_url = start_nats()
    redis = RedisServer().start()
    store = KvStoreProcess(nats_url, redis.url).wait_ready()
    port = free_port()
    proxy = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("slow_proxy.py")), "--listen", str(port),
         "--target", store.address, "--delay", str(DELAY)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proxy.stdout.readline().strip() == "READY"
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop_process(proxy)
        store.stop()
        redis.stop()
        stop_process(nats_proc)


def shared_kv(llm: AsyncLLM, folder, address: str) -> SharedKv:
    client = KvStoreClient(address, model_fingerprint(str(folder), llm), timeout=10.0)
    return SharedKv(llm, client, "w", policy="prefix")


def timed_steps(llm: AsyncLLM) -> list[float]:
    """When each engine step starts, from now on: the time from one to the next is a
    step with whatever the engine thread did before the next (a call queued by the
    shared tier's code would be there)."""
    engine, starts = llm._engine, []
    step = type(engine).step

    def timed():
        starts.append(time.perf_counter())
        return step(engine)

    engine.step = timed
    return starts


def periods(starts: list[float]) -> list[float]:
    return [b - a for a, b in zip(starts, starts[1:])]


async def decode_window(llm: AsyncLLM, batch, tag: str) -> list[int]:
    async def one(i, prompt):
        tokens = []
        async for out in llm.generate(prompt, DECODE, f"{tag}-{i}", delta=True):
            assert not out.error
            tokens += out.outputs[0].token_ids
        return len(tokens)

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))


def test_a_slow_store_leaves_the_engine_steps_alone(model_dir, slow_store):
    folder = model_dir("tiny-llama")

    async def run():
        # another worker's prompts in the store, for this one to fetch later
        writer = AsyncLLM.from_model(folder, **ENGINE)
        theirs = prompts(6, 96, seed=1)
        w = shared_kv(writer, folder, slow_store)
        for i, p in enumerate(theirs):
            async for _out in writer.generate(p, SamplingParams(max_tokens=1), f"t{i}"):
                pass
            w.write_through(p, [], "")
        await w.drain()
        assert w.stats.written_blocks == 6 * 6
        writer.close()

        llm = AsyncLLM.from_model(folder, **ENGINE)
        shared = shared_kv(llm, folder, slow_store)
        ours = prompts(6, 96, seed=2)
        for i, p in enumerate(ours):  # computed here, written through during a window
            async for _out in llm.generate(p, SamplingParams(max_tokens=1), f"o{i}"):
                pass
        steps = timed_steps(llm)
        quiet, busy, fetched = [], [], 0
        for round_ in range(2):
            start = len(steps)
            lengths = await decode_window(llm, prompts(8, 40, seed=10 + round_), f"q{round_}")
            assert lengths == [DECODE.max_tokens] * 8
            quiet += periods(steps[start:])
            start = len(steps)
            began = time.monotonic()
            for p in ours[round_ * 3 : round_ * 3 + 3]:
                shared.write_through(p, [], "")
            store_work = asyncio.gather(
                *(shared.prefetch(p, "") for p in theirs[round_ * 3 : round_ * 3 + 3]),
                shared.drain(),
            )
            lengths = await decode_window(llm, prompts(8, 40, seed=20 + round_), f"b{round_}")
            decoded = time.monotonic()
            results = await store_work
            fetched += sum(results[:3])
            assert lengths == [DECODE.max_tokens] * 8
            busy += periods(steps[start:])
            assert time.monotonic() - began >= 2 * DELAY  # the store really was slow
            assert decoded - began > 2 * DELAY  # and the decoding overlapped it
        llm.close()
        return quiet, busy, fetched, shared.stats

    quiet, busy, fetched, stats = asyncio.run(run())
    # 96-token prompts: 5 blocks each can be fetched (one token is always computed)
    assert fetched == 6 * 5 * 16 and stats.fetched_blocks == 6 * 5
    assert stats.written_blocks == 6 * 6 and stats.dropped_blocks == 0
    ratio = statistics.median(busy) / statistics.median(quiet)
    assert ratio < 1.05, (ratio, statistics.median(quiet), statistics.median(busy))
    # and no step waited for the store: a round trip to it takes at least 2 * DELAY
    assert max(busy) < DELAY, max(busy)
