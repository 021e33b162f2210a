"""What an engine worker tells the rest of the mesh, free of gRPC: its load
(running and waiting requests, KV cache use; the heartbeat the scheduler
places by) and its KV events, numbered so that a lost batch is noticed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine import AsyncLLM


@dataclass(slots=True)
class KvEventBatch:
    event_id: int
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    host_stored: list[int] = field(default_factory=list)
    host_removed: list[int] = field(default_factory=list)
    reset: bool = False  # a full snapshot: forget what you knew of this worker


class WorkerReports:
    def __init__(self, engine: AsyncLLM, worker_id: str):
        self.engine = engine
        self.worker_id = worker_id
        self._event_id = 0

    def load(self) -> dict:
        stats = self.engine.get_stats()
        return {
            "worker_id": self.worker_id,
            "num_requests_running": stats["num_requests_running"],
            "num_requests_waiting": stats["num_requests_waiting"],
            "kv_cache_usage": stats["kv_cache_usage"],
            "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"],
            "kv_blocks_total": stats["kv_blocks_total"],
            "kv_blocks_free": stats["kv_blocks_free"],
            "num_preemptions": stats["num_preemptions"],
            "timestamp": time.time(),
        }

    def cache_stats(self) -> dict:
        """Where prompt tokens came from (tokens, so far), and how full blocks are."""
        stats = self.engine.get_stats()
        host = stats["prefix_cache_host_hit_tokens"]
        return {
            "queried_tokens": stats["prefix_cache_queried_tokens"],
            "hit_tokens": {"gpu": stats["prefix_cache_hit_tokens"] - host, "host": host},
            "fragmentation": stats["kv_fragmentation"],
            "bytes_to_host": stats["host_kv_bytes_to_host"],
            "bytes_to_device": stats["host_kv_bytes_to_device"],
            "host_blocks": {
                "cached": stats["host_kv_blocks_cached"],
                "evicted": stats["host_kv_blocks_evicted"],
                "refused": stats["host_kv_stores_refused"],
            },
        }

    def step_stats(self) -> dict:
        """How many steps ran and where the engine thread's time went (seconds, so far)."""
        stats = self.engine.get_stats()
        return {
            "steps": stats["num_steps"],
            "wait_seconds": stats["step_wait_seconds"],
            "device_seconds": stats["step_device_seconds"],
            "device_timed": stats["steps_device_timed"],
            "thread_seconds": stats["engine_thread_seconds"],
            # speculative decoding, when on: drafts verified and kept, kept by position
            "draft_tokens": stats.get("spec_draft_tokens"),
            "accepted_tokens": stats.get("spec_accepted_tokens"),
            "acceptance_by_position": stats.get("spec_acceptance_by_position", []),
        }

    def kv_events(self) -> KvEventBatch | None:
        """The next numbered batch of KV events; the first one says `reset`."""
        events = self.engine.drain_kv_events()
        first = self._event_id == 0
        if not (events or first):
            return None
        self._event_id += 1
        return KvEventBatch(
            self._event_id,
            events.stored,
            events.removed,
            events.host_stored,
            events.host_removed,
            reset=first,
        )

    async def snapshot(self) -> KvEventBatch:
        """A numbered reset batch listing everything held now (the answer to a resync)."""
        device, host = await self.engine.kv_snapshot()
        self._event_id += 1
        return KvEventBatch(self._event_id, device, host_stored=host, reset=True)
