"""The engine's statistics: what load reports, metrics and benchmarks read.

`kv_fragmentation` is allocated-but-unused token slots over allocated slots,
counting each running sequence's computed tokens as used.
"""

from __future__ import annotations


def engine_stats(scheduler, kv, runner, host=None) -> dict:
    running, waiting = scheduler.running, scheduler.waiting
    held = {s.seq_id: s.num_computed_tokens for s in running}
    cache = kv.stats(held)
    running_ids = {s.request_id for s in running}
    return {
        "num_requests_running": len(running_ids),
        "num_requests_waiting": len({s.request_id for s in waiting} - running_ids),
        "kv_cache_usage": cache.usage,
        "kv_blocks_total": cache.num_blocks,
        "kv_blocks_free": cache.num_free_blocks,
        "kv_blocks_used": cache.num_used_blocks,
        "prefix_cache_queried_tokens": cache.prefix_queried_tokens,
        "prefix_cache_hit_tokens": cache.prefix_hit_tokens,
        "prefix_cache_hit_rate": cache.prefix_hit_rate,
        "kv_fragmentation": cache.fragmentation,
        "num_preemptions": scheduler.num_preemptions,
        "num_tokens_processed": runner.num_tokens_processed,
        "prefix_cache_host_hit_tokens": cache.host_hit_tokens,
        "host_kv_blocks_total": host.pool.num_blocks if host is not None else 0,
        "host_kv_blocks_cached": host.pool.num_cached if host is not None else 0,
        "host_kv_blocks_evicted": host.pool.num_evicted if host is not None else 0,
        "host_kv_stores_refused": host.pool.num_refused if host is not None else 0,
        "host_kv_bytes_to_host": host.stats.bytes_to_host if host is not None else 0,
        "host_kv_bytes_to_device": host.stats.bytes_to_device if host is not None else 0,
        "host_kv_load_seconds": host.stats.load_seconds if host is not None else 0.0,
    }
