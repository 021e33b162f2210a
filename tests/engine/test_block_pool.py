"""The block pool and KV cache manager on tiny pools: exact block ids,
ref counts, LRU eviction order, chained hashes, and the reported statistics."""

from __future__ import annotations

import pytest

from basis.block_hash import hash_block_tokens, hash_prompt_blocks
from basis.sampling_params import SamplingParams
from engine.block_pool import BlockPool
from engine.kv_cache_manager import CachedPrefix, KVCacheManager
from engine.sequence import Sequence


def seq(seq_id: str, tokens: list[int], namespace: str = "") -> Sequence:
    return Sequence(seq_id, seq_id, 0, tokens, SamplingParams(), frozenset(), namespace=namespace)


def test_allocation_takes_from_front_and_never_hands_out_null_block():
    pool = BlockPool(5)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert pool.num_free_blocks == 1
    with pytest.raises(ValueError):
        pool.allocate(2)


def test_freed_cached_blocks_are_evicted_least_recently_used():
    pool = BlockPool(6)
    a, b, c = pool.allocate(3)
    for block, h in ((a, 101), (b, 102), (c, 103)):
        pool.cache_block(block, h)
    pool.free([c, b])  # tail first, as a sequence frees
    pool.free([a])
    # free queue: 4, 5, then c, b, a in the order freed
    assert [x.block_id for x in pool.allocate(2)] == [4, 5]
    assert pool.lookup(103) is c
    assert [x.block_id for x in pool.allocate(1)] == [3]  # c evicted first
    assert pool.lookup(103) is None and pool.lookup(102) is b
    events = pool.drain_events()
    assert events.stored == [101, 102, 103] and events.removed == [103]


def test_touch_revives_a_cached_free_block():
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 7)
    pool.free([a])
    assert pool.num_free_blocks == 3
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    with pytest.raises(RuntimeError):
        pool.free([a, a])


def test_chained_hashes_depend_on_parent_and_namespace():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 != hash_block_tokens(None, [1, 2, 3, 4], "tenant-a")
    assert hash_block_tokens(h1, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_prompt_blocks(list(range(10)), 4) == [
        hash_block_tokens(None, [0, 1, 2, 3]),
        hash_block_tokens(hash_block_tokens(None, [0, 1, 2, 3]), [4, 5, 6, 7]),
    ]


def test_manager_prefix_hit_and_statistics():
    kv = KVCacheManager(num_blocks=9, block_size=4)
    a = seq("a", list(range(10)))
    assert kv.allocate_slots(a, 10, kv.find_cached_prefix(a))
    assert kv.block_ids(a) == [1, 2, 3]
    a.num_computed_tokens = 10
    kv.commit(a)  # blocks 1 and 2 are full and now shared
    stats = kv.stats({"a": 10})
    assert stats.num_used_blocks == 3 and stats.num_free_blocks == 5
    assert stats.fragmentation == pytest.approx(2 / 12)

    b = seq("b", list(range(8)) + [99, 98, 97])
    cached = kv.find_cached_prefix(b)
    assert [blk.block_id for blk in cached.blocks] == [1, 2] and not cached.host_slots
    assert kv.allocate_slots(b, 3, cached)
    assert b.num_computed_tokens == 8 and kv.block_ids(b) == [1, 2, 4]
    stats = kv.stats({"a": 10, "b": 11})
    assert stats.prefix_hit_tokens == 8 and stats.prefix_queried_tokens == 21
    assert stats.num_used_blocks == 4
    assert stats.fragmentation == pytest.approx((2 + 1) / 16)


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = seq("a", list(range(20)))
    assert not kv.allocate_slots(a, 20, CachedPrefix())
    assert kv.block_ids(a) == [] and kv.pool.num_free_blocks == 3
    assert a.num_computed_tokens == 0


def test_other_namespace_misses():
    kv = KVCacheManager(num_blocks=9, block_size=4)
    a = seq("a", list(range(9)), namespace="x")
    assert kv.allocate_slots(a, 9, CachedPrefix())
    a.num_computed_tokens = 9
    kv.commit(a)
    assert len(kv.find_cached_prefix(seq("b", list(range(9)), namespace="y"))) == 0
    assert len(kv.find_cached_prefix(seq("c", list(range(9)), namespace="x"))) == 2
