"""The host tier of the KV cache: blocks that leave the device are kept in host
memory and loaded back for the next prompt that shares them, with outputs
exactly those of recomputing; the bookkeeping evicts least recently used
blocks and never reuses a slot a copy is using."""

from __future__ import annotations

import pytest
import torch

from basis.block_hash import hash_prompt_blocks
from engine import LLM, SamplingParams
from engine.host_pool import HostBlockPool

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    return [[(seed * 31 + i * 7 + j * 3) % 480 + 1 for j in range(length)] for i in range(n)]


def test_pool_evicts_least_recently_used_and_reports_events():
    pool = HostBlockPool(3)
    slots = [pool.begin_store(h) for h in (10, 11, 12)]
    assert sorted(slots) == [0, 1, 2]
    for s in slots:
        pool.end_store(s)
    assert pool.lookup(10) == slots[0]  # 10 is now the most recently used
    new = pool.begin_store(13)  # evicts 11, the least recently used
    assert new == slots[1] and pool.lookup(11) is None
    assert pool.lookup(13) is None  # not readable until its copy is done
    pool.end_store(new)
    assert pool.lookup(13) == new
    events = pool.drain_events()
    assert events.stored == [10, 11, 12, 13] and events.removed == [11]
    assert pool.begin_store(13) is None  # already here: no second copy
    assert (pool.num_evicted, pool.num_refused) == (1, 0)  # counted for the metrics


def test_pool_never_reuses_a_pinned_slot():
    pool = HostBlockPool(2)
    a, b = pool.begin_store(1), pool.begin_store(2)
    pool.end_store(a)
    pool.end_store(b)
    pool.pin(a)  # a load is reading it
    assert pool.begin_store(3) == b  # the only unpinned slot
    assert pool.begin_store(4) is None  # a is pinned, b is being written
    assert (pool.num_evicted, pool.num_refused) == (1, 1)  # 2 gave way to 3; 4 refused
    pool.unpin(a)
    pool.end_store(b)
    assert pool.begin_store(4) == a


def test_failed_store_leaves_an_empty_slot_used_first():
    pool = HostBlockPool(2)
    a = pool.begin_store(1)
    pool.end_store(a, ok=False)
    assert pool.lookup(1) is None
    b = pool.begin_store(2)
    assert b == a


def test_a_prefix_reused_on_the_device_keeps_its_host_copy_fresh(model_dir):
    # A conversation's head is reused from the device at every turn; its host copy,
    # made once, must not age out behind blocks nobody read twice.
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm = LLM(model_dir("tiny-llama"), device="cpu", dtype="float32", num_gpu_blocks=40,
              host_kv_cache_gb=24 * 8192 / (1 << 30))  # fmt: skip
    host = llm.engine.tiers.host
    assert host.pool.num_blocks == 24

    def run(batch):
        llm.generate(batch, one)
        llm.engine.housekeeping()  # the freed blocks' backups

    head = prompts(1, 65, seed=3)[0]  # 4 full blocks, then one token to compute
    first = hash_prompt_blocks(head, 16, "")[0]
    run([head])
    run(prompts(4, 65, seed=10))  # 16 blocks more: the head's copies are the oldest
    hits = llm.get_stats()["prefix_cache_hit_tokens"]
    run([head])  # from the device: its copies are used again
    assert llm.get_stats()["prefix_cache_hit_tokens"] - hits == 64
    run(prompts(2, 65, seed=20))  # 8 blocks more through the 24-slot tier
    assert host.pool.holds(first)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_host_hits_give_the_outputs_of_recomputing(model_dir, async_scheduling):
    folder = model_dir("tiny-llama")
    opts = dict(device="cpu", dtype="float32", num_gpu_blocks=30, async_scheduling=async_scheduling)
    batch = prompts(10, 150, seed=1)
    want = [o.outputs[0].token_ids for o in LLM(folder, host_kv_cache_gb=0, **opts).generate(
        batch, GREEDY
    )]  # fmt: skip
    llm = LLM(folder, host_kv_cache_gb=0.05, **opts)
    first = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]
    # 10 prompts of 10 blocks in a 29-block device pool: the first ones were evicted
    again = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]
    stats = llm.get_stats()
    assert first == want and again == want
    assert stats["prefix_cache_host_hit_tokens"] >= 5 * 144
    assert stats["host_kv_bytes_to_device"] > 0


def test_host_tier_with_chunked_prefill_preemption_and_forks(model_dir):
    folder = model_dir("tiny-qwen3")
    opts = dict(device="cpu", dtype="float32", num_gpu_blocks=24, max_prefill_chunk=7)
    batch = prompts(6, 90, seed=2)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, n=2)
    want = LLM(folder, host_kv_cache_gb=0, **opts).generate(batch, params)
    llm = LLM(folder, host_kv_cache_gb=0.05, **opts)
    for _ in range(2):
        got = llm.generate(batch, params)
        for g, w in zip(got, want):
            assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
    assert llm.get_stats()["num_preemptions"] > 0
    assert llm.get_stats()["prefix_cache_host_hit_tokens"] > 0


def test_blocks_move_between_engines_through_export_and_import(model_dir):
    """What the shared tier does: one engine's blocks, as bytes, let another skip
    the prefix, with equal outputs."""
    folder = model_dir("tiny-llama")
    opts = dict(device="cpu", dtype="float32", host_kv_cache_gb=0.05)
    prompt = prompts(1, 100, seed=3)[0]
    a, b = LLM(folder, **opts), LLM(folder, **opts)
    want = a.generate([prompt], GREEDY)[0].outputs[0].token_ids
    a.engine.housekeeping()
    hashes = hash_prompt_blocks(prompt, 16)
    data = a.engine.tiers.export_blocks(hashes)
    assert len(data) == len(hashes) == 6
    assert all(len(d) == a.engine.tiers.block_bytes for d in data)
    assert b.engine.tiers.import_blocks(list(zip(hashes, data))) == 6
    assert b.engine.tiers.import_blocks([(1, b"short")]) == 0  # wrong size: refused
    assert b.engine.tiers.cached_prefix_blocks(prompt) == 6
    out = b.generate([prompt], GREEDY)[0]
    assert out.outputs[0].token_ids == want
    assert out.num_cached_tokens == 96


def test_lent_blocks_go_straight_into_device_blocks_and_keep_their_prefix(model_dir):
    """What a lend does: blocks from memory outside the engine are copied into device
    blocks held for them and become device hits behind the prefix the device holds;
    holding them never evicts that prefix, even at the front of the LRU queue."""
    folder = model_dir("tiny-llama")
    prompt = prompts(1, 100, seed=5)[0]
    a = LLM(folder, device="cpu", dtype="float32", host_kv_cache_gb=0.05)
    want = a.generate([prompt], GREEDY)[0].outputs[0].token_ids
    a.engine.housekeeping()
    hashes = hash_prompt_blocks(prompt, 16)
    facts = a.engine.facts
    rows = [
        torch.frombuffer(bytearray(d), dtype=facts.kv_dtype).view(
            facts.num_layers, *facts.kv_block_shape
        )
        for d in a.engine.tiers.export_blocks(hashes)
    ]
    # b holds the first two blocks, least recently used, and has room for few more
    b = LLM(folder, device="cpu", dtype="float32", host_kv_cache_gb=0, num_gpu_blocks=20)
    b.generate([prompt[:33]], GREEDY)
    for filler in prompts(5, 40, seed=6):  # every other block used since: the prefix is oldest
        b.generate([filler], GREEDY)
    engine = b.engine
    ids = engine.import_device_begin(hashes, 2)
    assert len(ids) == 4 and engine.tiers.peek_device_prefix(hashes) == 2  # prefix kept
    engine.tiers.copy_into_blocks(rows[2:], ids)()
    engine.import_device_end(ids, hashes[2:], 3)  # the last one "failed its check"
    assert engine.tiers.peek_device_prefix(hashes) == 5
    out = b.generate([prompt], GREEDY)[0]
    assert out.outputs[0].token_ids == want
    assert out.num_cached_tokens == 80
    assert engine.import_device_begin(hashes, 1) == []  # nothing left to hold
    assert engine.import_device_begin([999, *hashes[1:]], 1) == []  # a prefix it lacks


def test_kv_events_report_the_host_tier(model_dir):
    llm = LLM(model_dir("tiny-llama"), device="cpu", dtype="float32", num_gpu_blocks=12,
              host_kv_cache_gb=0.0001)  # fmt: skip
    llm.generate(prompts(4, 60, seed=4), GREEDY)
    events = llm.engine.drain_kv_events()
    assert events.stored and events.host_stored
    assert set(events.host_stored) <= set(events.stored)
    assert llm.engine.tiers.host.pool.num_blocks < 20 and events.host_removed  # a small tier


def test_host_tier_off(model_dir):
    llm = LLM(model_dir("tiny-llama"), device="cpu", host_kv_cache_gb=0)
    assert llm.engine.tiers.host is None
    assert llm.get_stats()["host_kv_blocks_total"] == 0
    with pytest.raises(ValueError):
        LLM(model_dir("tiny-llama"), device="cpu", host_kv_cache_gb=-1)
