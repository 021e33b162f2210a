"""A worker's write queue to the shared tier, against a real `python -m
services.kvstore` on Redis: a write larger than the room left in the queue
stores the prompt's leading blocks that fit and drops (and counts) only its
tail; nothing waits; the worker's metrics say what is queued."""

from __future__ import annotations

import asyncio

import pytest
from kvstore_helpers import ENGINE, prompts
from kvstore_process import KvStoreProcess
from redis_server import RedisServer, redis_server_binary

from basis.block_hash import hash_prompt_blocks
from engine import AsyncLLM, SamplingParams
from services.common import metrics
from services.common.processes import start_nats, stop_process
from services.worker.host import model_fingerprint
from services.worker.kvstore_client import KvStoreClient
from services.worker.shared_kv import SharedKv

pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="no redis-server")


@pytest.fixture(scope="module")
def store_address():
    nats_proc, nats_url = start_nats()
    redis = RedisServer().start()
    store = KvStoreProcess(nats_url, redis.url).wait_ready()
    try:
        yield store.address
    finally:
        store.stop()
        redis.stop()
        stop_process(nats_proc)


def pending_bytes() -> float:
    return metrics.WORKER.get_sample_value("yinian:kv_shared_pending_bytes", {"worker": "w"})


def test_a_write_beyond_the_queue_keeps_the_prompts_head(model_dir, store_address):
    folder = model_dir("tiny-llama")

    async def run():
        llm = AsyncLLM.from_model(folder, **ENGINE)
        client = KvStoreClient(store_address, model_fingerprint(str(folder), llm), timeout=10.0)
        shared = SharedKv(llm, client, "w", policy="prefix")
        shared.max_pending_bytes = 2 * shared.block_bytes  # room for two blocks
        prompt = prompts(1, 96, seed=5)[0]  # six whole blocks
        async for _out in llm.generate(prompt, SamplingParams(max_tokens=1), "r"):
            pass
        shared.write_through(prompt, [], "")
        queued = pending_bytes()  # what /metrics says waits, until the store has it
        await shared.drain()
        held = await client.lookup("", hash_prompt_blocks(prompt, 16, "", 0))
        await client.close()
        llm.close()
        return shared.stats, held, queued, shared.block_bytes

    stats, held, queued, block_bytes = asyncio.run(run())
    assert stats.written_blocks == 2 and stats.dropped_blocks == 4
    assert queued == 2 * block_bytes and pending_bytes() == 0
    assert held == 2  # the store holds the prompt's first two blocks
