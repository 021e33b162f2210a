"""Blocks the memory tier evicts, moved into Redis in the background: a queue
bounded in bytes (a block that finds it full is dropped and counted, never
waited for), drained by one task that puts each block through the shared
tier's usual checks. A block that does not reach Redis is announced removed."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from services.common import metrics
from services.kvstore.memory_tier import Evicted
from services.kvstore.shared_tier import SharedTier

logger = logging.getLogger(__name__)


class Spiller:
    def __init__(
        self,
        tier: SharedTier,
        max_bytes: int,
        on_removed: Callable[[list[int]], None] = lambda removed: None,
    ):
        self.tier, self.max_bytes, self.on_removed = tier, max_bytes, on_removed
        self._queue: deque[Evicted] = deque()
        self._bytes = 0
        self._wake = asyncio.Event()

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    def offer(self, block: Evicted) -> bool:
        """Queues the block for Redis; False (and counted) when the queue is full."""
        if self._bytes + len(block.payload) > self.max_bytes:
            metrics.KVSTORE_SPILLED_BLOCKS.labels(outcome="dropped").inc()
            return False
        self._queue.append(block)
        self._bytes += len(block.payload)
        self._wake.set()
        return True

    async def drain(self) -> None:
        """Puts every queued block (the app runs this as a task until it stops)."""
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            block = self._queue.popleft()
            try:
                outcome = await self.tier.put(
                    block.owner, block.fingerprint, block.block_hash, block.parent,
                    block.payload, block.checksum,
                )  # fmt: skip
            except Exception:  # noqa: BLE001 - a failed spill is a lost cache entry, not a crash
                logger.exception("spilling a block to Redis failed")
                outcome = None
            finally:
                self._bytes -= len(block.payload)
            stored = outcome is not None and outcome.status != "rejected"
            metrics.KVSTORE_SPILLED_BLOCKS.labels(outcome="stored" if stored else "rejected").inc()
            if not stored:
                self.on_removed([block.block_hash])
