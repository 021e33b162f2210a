"""The shared tier as an engine worker uses it, free of gRPC (the KV store
client is handed in): before a prompt runs, the blocks it lacks locally that
the shared tier holds are fetched, checked, and put into the engine's host
tier, where admission finds them; after a request, the blocks it computed are
written through, under a policy:

- `none`: nothing is written;
- `prefix`: the prompt's full blocks (a later request with this prefix, on any
  worker, skips it);
- `all`: also the blocks of the generated tokens (the next turn of a
  conversation, whose prompt holds this answer, skips it too).

A block's hash is what it holds (chained over the prompt and salted with the
tenant), so a fetched block is used only under the hash the prompt asks for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from basis.block_hash import PUBLIC_NAMESPACE, hash_prompt_blocks
from engine import AsyncLLM
from services.common import metrics
from services.common.telemetry import tracer
from services.common.worker_config import WRITE_THROUGH

logger = logging.getLogger(__name__)
_tracer = tracer("yinian.kv")
_REMEMBERED = 1 << 16  # hashes known to be in the store, not written again


@dataclass(slots=True)
class SharedKvStats:
    fetched_blocks: int = 0
    fetched_bytes: int = 0
    fetch_seconds: float = 0.0
    rejected_blocks: int = 0  # came back but failed a check here
    written_blocks: int = 0


class SharedKv:
    def __init__(self, engine: AsyncLLM, client, worker_id: str, policy: str = "prefix"):
        if policy not in WRITE_THROUGH:
            raise ValueError(f"write-through policy must be one of {WRITE_THROUGH}, got {policy!r}")
        self.engine = engine
        self.client = client
        self.worker_id = worker_id
        self.policy = policy
        self.block_size = engine.facts.block_size
        self.stats = SharedKvStats()
        self._written: OrderedDict[int, None] = OrderedDict()
        self._tasks: set[asyncio.Task] = set()

    async def prefetch(self, prompt_ids: list[int], tenant: str, public_tokens: int = 0) -> int:
        """Fetches the prompt's missing leading blocks from the shared tier into the
        host tier; returns the prompt tokens it made local. (The store answers a
        tenant with its own blocks and the public namespace's.)"""
        with _tracer.start_as_current_span("kv.shared_fetch") as span:
            tokens = await self._prefetch(prompt_ids, tenant, public_tokens)
            span.set_attribute("yinian.kv_shared_tokens", tokens)
            return tokens

    async def _prefetch(self, prompt_ids: list[int], tenant: str, public_tokens: int) -> int:
        limit = (len(prompt_ids) - 1) // self.block_size  # one token is always computed
        hashes = hash_prompt_blocks(prompt_ids, self.block_size, tenant, public_tokens)[:limit]
        if not hashes or not self.engine.facts.has_host_tier:
            return 0
        head = prompt_ids[: limit * self.block_size]
        local = await self.engine.cached_prefix_blocks(head, tenant, public_tokens)
        missing = hashes[local:]
        if not missing:
            return 0
        start = time.monotonic()
        count = await self.client.lookup(tenant, missing)
        if count == 0:
            return 0
        blocks = await self.client.get(tenant, missing[:count])
        checked = []
        for i, (block_hash, parent, data) in enumerate(blocks):
            expected_parent = hashes[local + i - 1] if local + i > 0 else 0
            if parent != expected_parent or len(data) != self.engine.facts.kv_block_bytes:
                self.stats.rejected_blocks += 1
                metrics.KV_SHARED_REJECTED.labels(worker=self.worker_id).inc()
                logger.warning("shared block %x does not fit this prompt; recomputing", block_hash)
                break
            checked.append((block_hash, data))
        taken = await self.engine.import_blocks(checked)
        seconds = time.monotonic() - start
        nbytes = sum(len(d) for _, d in checked[:taken])
        self.stats.fetched_blocks += taken
        self.stats.fetched_bytes += nbytes
        self.stats.fetch_seconds += seconds
        metrics.KV_SHARED_FETCHED_TOKENS.labels(worker=self.worker_id).inc(taken * self.block_size)
        metrics.KV_SHARED_BYTES.labels(worker=self.worker_id, direction="in").inc(nbytes)
        metrics.KV_SHARED_FETCH_SECONDS.observe(seconds)
        for block_hash, _ in checked[:taken]:
            self._remember(block_hash)
        return taken * self.block_size

    def write_through(
        self, prompt_ids: list[int], output_ids: list[int], tenant: str, public_tokens: int = 0
    ) -> None:
        """Starts writing the request's blocks, as the policy says, in the background."""
        if self.policy == "none":
            return
        tokens = prompt_ids if self.policy == "prefix" else prompt_ids + output_ids
        hashes = hash_prompt_blocks(tokens, self.block_size, tenant, public_tokens)
        if not hashes or all(h in self._written for h in hashes):
            return
        public = public_tokens // self.block_size
        task = asyncio.get_running_loop().create_task(self._write(hashes, tenant, public))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write(self, hashes: list[int], tenant: str, public_blocks: int) -> None:
        try:
            data = await self.engine.export_blocks(hashes)
        except RuntimeError:  # the engine shut down meanwhile
            return
        todo = [
            (i, (h, hashes[i - 1] if i else 0, d))
            for i, (h, d) in enumerate(zip(hashes, data))
            if h not in self._written
        ]
        stored = 0
        # the public prefix's blocks belong to the public namespace, the rest to the tenant
        for owner, part in (
            (PUBLIC_NAMESPACE, [b for i, b in todo if i < public_blocks]),
            (tenant, [b for i, b in todo if i >= public_blocks]),
        ):
            if not part:
                continue
            done = await self.client.put(owner, part)
            if done == len(part):
                for h, _, _ in part:
                    self._remember(h)
            stored += done
        blocks = [b for _, b in todo]
        self.stats.written_blocks += stored
        metrics.KV_SHARED_WRITTEN_BLOCKS.labels(worker=self.worker_id).inc(stored)
        metrics.KV_SHARED_BYTES.labels(worker=self.worker_id, direction="out").inc(
            sum(len(d) for _, _, d in blocks)
        )

    def _remember(self, block_hash: int) -> None:
        self._written[block_hash] = None
        self._written.move_to_end(block_hash)
        if len(self._written) > _REMEMBERED:
            self._written.popitem(last=False)

    async def drain(self) -> None:
        """Waits for the writes in flight (at shutdown)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
