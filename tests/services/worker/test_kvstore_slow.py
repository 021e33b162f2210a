"""A slow KV store does not slow the engine: with every byte to and from the
store 100 ms late (a delaying proxy in front of a real `python -m
services.kvstore` on Redis), a worker's shared-tier reads and writes run
beside 8 decoding requests, and the engine's steps take what they take with no
store activity at all (median), its thread never waiting a round trip to the
store between them; every request ends with its whole output."""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time

import pytest
from kvstore_helpers import ENGINE, prompts
from kvstore_process import KvStoreProcess
from paths import TESTS
from redis_server import RedisServer, redis_server_binary

from engine import AsyncLLM, SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from services.common.processes import free_port, start_nats, stop_process
from services.worker.host import model_fingerprint
from services.worker.kvstore_client import KvStoreClient
from services.worker.shared_kv import SharedKv

pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="no redis-server")
DELAY = 0.1
ROUNDS = 4  # quiet and busy windows, interleaved, in one pass
PASSES = 3
DECODE = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def slow_store():
    nats_proc, nats_url = start_nats()
    redis = RedisServer().start()
    store = KvStoreProcess(nats_url, redis.url).wait_ready()
    port = free_port()
    proxy = subprocess.Popen(
        [sys.executable, str(TESTS / "slow_proxy.py"), "--listen", str(port),
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


def timed_engine(folder) -> tuple[AsyncLLM, list[tuple[float, float, float]]]:
    """An engine, and (start, end, CPU seconds of the engine's thread) of each step."""
    engine, steps = LLMEngine(folder, EngineConfig.from_options(**ENGINE)), []
    step = engine.step

    def timed():  # runs on the engine's thread
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return step()
        finally:
            steps.append((start, time.perf_counter(), time.thread_time() - cpu))

    engine.step = timed
    return AsyncLLM(engine), steps


def durations(steps) -> list[float]:
    return [end - start for start, end, _ in steps]


def gaps(steps) -> list[float]:
    """From one step's start to the next's: a step with whatever the engine thread did
    before the next (a call queued by the shared tier's code would be there)."""
    return [b[0] - a[0] for a, b in zip(steps, steps[1:])]


async def decode_window(llm: AsyncLLM, batch, tag: str) -> list[int]:
    async def one(i, prompt):
        tokens = []
        async for out in llm.generate(prompt, DECODE, f"{tag}-{i}", delta=True):
            assert not out.error
            tokens += out.outputs[0].token_ids
        return len(tokens)

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))


@pytest.mark.alone  # its bounds need the machine's cores
def test_a_slow_store_leaves_the_engine_steps_alone(model_dir, slow_store):
    folder = model_dir("tiny-llama")
    per_pass = 2 * ROUNDS  # prompts fetched (and written) in one pass of the rounds

    async def run():
        # another worker's prompts in the store, for this one to fetch later
        writer = AsyncLLM.from_model(folder, **ENGINE)
        theirs = prompts(PASSES * per_pass, 96, seed=1)
        w = shared_kv(writer, folder, slow_store)
        for i, p in enumerate(theirs):
            async for _out in writer.generate(p, SamplingParams(max_tokens=1), f"t{i}"):
                pass
            w.write_through(p, [], "")
        await w.drain()
        assert w.stats.written_blocks == len(theirs) * 6
        writer.close()

        llm, steps = timed_engine(folder)
        shared = shared_kv(llm, folder, slow_store)
        ours = prompts(PASSES * per_pass, 96, seed=2)
        for i, p in enumerate(ours):  # computed here, written through during a window
            async for _out in llm.generate(p, SamplingParams(max_tokens=1), f"o{i}"):
                pass
        ratios, max_gaps, fetched, passes = [], [], 0, 0
        while passes < PASSES and not (ratios and min(ratios) < 1.05 and min(max_gaps) < DELAY):
            quiet, busy, busy_gaps = [], [], []
            for n in range(passes * ROUNDS, (passes + 1) * ROUNDS):
                start = len(steps)
                lengths = await decode_window(llm, prompts(8, 40, seed=100 + n), f"q{n}")
                assert lengths == [DECODE.max_tokens] * 8
                quiet += durations(steps[start:])
                start = len(steps)
                began = time.monotonic()
                for p in ours[n * 2 : n * 2 + 2]:
                    shared.write_through(p, [], "")
                store_work = asyncio.gather(
                    *(shared.prefetch(p, "") for p in theirs[n * 2 : n * 2 + 2]),
                    shared.drain(),
                )
                lengths = await decode_window(llm, prompts(8, 40, seed=200 + n), f"b{n}")
                decoded = time.monotonic()
                results = await store_work
                fetched += sum(results[:2])
                assert lengths == [DECODE.max_tokens] * 8
                busy += durations(steps[start:])
                busy_gaps += gaps(steps[start:])
                assert time.monotonic() - began >= 2 * DELAY  # the store really was slow
                assert decoded - began > 2 * DELAY  # and the decoding overlapped it
            ratios.append(statistics.median(busy) / statistics.median(quiet))
            max_gaps.append(max(busy_gaps))
            passes += 1
        llm.close()
        return ratios, max_gaps, fetched, passes, shared.stats

    ratios, max_gaps, fetched, passes, stats = asyncio.run(run())
    # 96-token prompts: 5 blocks each can be fetched (one token is always computed)
    assert fetched == passes * per_pass * 5 * 16 and stats.fetched_blocks == passes * per_pass * 5
    assert stats.written_blocks == passes * per_pass * 6 and stats.dropped_blocks == 0
    # The median step of the rounds with the store busy over that of the quiet rounds
    # between them. On this 2-core machine the store, Redis and the proxy take CPU from
    # the engine while they work, and one pass's ratio wanders by several percent: a pass
    # over the bound is measured again, at most PASSES times in all.
    assert min(ratios) < 1.05, ratios
    # and the engine's thread never waited for the store between steps: a round trip to
    # it takes at least 2 * DELAY. Every round of every pass reads and writes through the
    # store, so a thread that waited on it would show such a gap in each pass; a single
    # gap from the machine descheduling the thread (CI once saw 0.38 s in one pass of a
    # full suite run) is measured again like the ratio.
    assert min(max_gaps) < DELAY, max_gaps
