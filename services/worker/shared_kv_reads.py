"""A worker's reads of the shared tier (see shared_kv.py): before a prompt runs,
the leading blocks it lacks locally that the shared tier holds are made local:
those the store lends straight into device blocks (lent_blocks.py), the rest
(only in Redis, or a store elsewhere) into host-tier slots that the store fills
itself on this host (GetInto) or that this worker fills with bytes it got.
Every block is checked (chain, size, and the checksum of each that came by value
or through the host tier) before anything may read it."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

from basis.block_hash import cached_prompt_blocks
from services.common import metrics
from services.common.kv_checksum import block_checksum
from services.common.kv_index import SHARED, SHARED_HOLDER, KvIndex
from services.common.telemetry import tracer
from services.worker.lent_blocks import LentBlocks
from services.worker.shared_kv_link import SharedKvLink

logger = logging.getLogger("services.worker.shared_kv")
_tracer = tracer("yinian.kv")
# a GiB of blocks is ~60 ms of XXH3 on one core: checked over several
VERIFY_POOL = ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="kv-verify")


class SharedKvReads:
    def __init__(self, link: SharedKvLink, index: KvIndex | None, verify_lent: bool = False,
                 lend: bool = True):  # fmt: skip
        self.link = link
        self.index = index
        self.lend = lend  # False: the store's memory is never mapped here (no lent blocks)
        self.lent = LentBlocks(link, VERIFY_POOL if verify_lent else None)

    async def introduce(self) -> None:
        """Names this worker's host tier to the store ahead of any block, so that it
        maps the memory now and not on the first fetch (a GetInto of no blocks), and
        starts mapping the store's memory tier here (in the background), if it may."""
        link = self.link
        if link.region is not None:
            if await link.client.map_region(link.region, link.block_bytes) is None:
                link.no_region()
        if self.lend:
            await self.lent.introduce()

    async def prefetch(self, prompt_ids: list[int], tenant: str, public_tokens: int = 0) -> int:
        """Fetches the prompt's missing leading blocks from the shared tier: those the
        store lends straight into the device, the rest into the host tier; returns
        the prompt tokens it made local. (The store answers a tenant with its own
        blocks and the public namespace's.)"""
        with _tracer.start_as_current_span("kv.shared_fetch") as span:
            tokens = await self._prefetch(prompt_ids, tenant, public_tokens)
            span.set_attribute("yinian.kv_shared_tokens", tokens)
            return tokens

    async def _prefetch(self, prompt_ids: list[int], tenant: str, public_tokens: int) -> int:
        limit = (len(prompt_ids) - 1) // self.link.block_size  # one token is always computed
        size = self.link.block_size
        hashes = cached_prompt_blocks(prompt_ids, size, tenant, public_tokens)[:limit]
        if not hashes or not (self.link.engine.facts.has_host_tier or self.lent.mapped):
            return 0
        start = time.monotonic()
        indexed = None  # how many leading blocks the shared tier holds, by its events
        if self.index is not None and self.index.synced(SHARED_HOLDER):
            # What the tier's events say it holds, against what is here already: a
            # prompt the tier cannot extend costs no call to the store, nor a wait for
            # the engine's next step.
            if not self.index.holds_any(SHARED_HOLDER, SHARED, hashes):
                return self._outcome("not_indexed")
            local = self.link.engine.peek_cached_prefix(hashes)
            indexed = self.index.matched_blocks(SHARED_HOLDER, hashes, (SHARED,))
            if indexed <= local:
                return self._outcome("local")
        else:
            local = None
        lent = copied = 0
        if self.lent.mapped:
            if local is None:
                local = self.link.engine.peek_cached_prefix(hashes)
            lent = await self.lent.fetch(hashes, local, tenant)
            local += lent
        if self.link.engine.facts.has_host_tier and (indexed is None or indexed > local):
            copied = await self._copy_in(prompt_ids, hashes, local, tenant, public_tokens)
        filled = lent + copied
        self._outcome("filled" if filled else "missed")
        seconds = time.monotonic() - start
        self.link.stats.fetched_blocks += filled
        self.link.stats.lent_blocks += lent
        self.link.stats.fetched_bytes += filled * self.link.block_bytes
        self.link.stats.fetch_seconds += seconds
        for path, count in (("lent", lent), ("copied", copied)):
            metrics.KV_SHARED_FETCHED_TOKENS.labels(worker=self.link.worker_id, path=path).inc(
                count * self.link.block_size
            )
        metrics.KV_SHARED_BYTES.labels(worker=self.link.worker_id, direction="in").inc(
            filled * self.link.block_bytes
        )
        metrics.KV_SHARED_FETCH_SECONDS.observe(seconds)
        return filled * self.link.block_size

    def _outcome(self, outcome: str) -> int:
        metrics.KV_SHARED_PREFETCHES.labels(worker=self.link.worker_id, outcome=outcome).inc()
        return 0

    async def _copy_in(self, prompt_ids, hashes: list[int], local: int | None, tenant: str,
                       public_tokens: int) -> int:  # fmt: skip
        """The blocks after `local` that the shared tier holds, written into host-tier
        slots (by the store, on this host; else by value); how many were filled."""
        shared = await self.link.client.lookup(tenant, hashes)
        if shared == 0:
            return 0
        if local is None:  # not known yet: ask the engine, between its steps
            head = prompt_ids[: len(hashes) * self.link.block_size]
            local = await self.link.engine.cached_prefix_blocks(head, tenant, public_tokens)
        if shared <= local:
            return 0
        slots = await self.link.engine.import_begin(hashes[local:shared])
        if not slots:
            return 0
        filled = 0
        try:
            written = None
            if self.link.region is not None:
                offsets = [slot * self.link.block_bytes for _, slot in slots]
                written = await self.link.client.get_into(
                    tenant, self.link.region, self.link.block_bytes, [h for h, _ in slots], offsets
                )
                if written is None:
                    self.link.no_region()
                else:
                    filled = await asyncio.to_thread(self._verify, slots, written, hashes, local)
            if written is None:
                blocks = await self.link.client.get(tenant, [h for h, _ in slots])
                filled = await asyncio.to_thread(self._fill, slots, blocks, hashes, local)
        finally:
            await self.link.engine.import_end([s for _, s in slots], filled)
        for block_hash, _ in slots[:filled]:
            self.link.remember(block_hash)
        return filled

    def _verify(self, slots, written, hashes: list[int], local: int) -> int:
        """How many leading blocks the store wrote into their slots fit the prompt
        (parent chain) and hold what their checksum says (read here, in a thread)."""
        # a GiB of blocks is ~60 ms of XXH3 on one core: spread over a few
        sums = list(VERIFY_POOL.map(
            lambda slot: block_checksum(self.link.engine.host_slot_bytes(slot)),
            [slot for _, slot in slots[: len(written)]],
        ))  # fmt: skip
        for n, ((block_hash, _), (parent, checksum)) in enumerate(zip(slots, written)):
            i = local + n
            expected_parent = hashes[i - 1] if i > 0 else 0
            if parent != expected_parent or sums[n] != checksum:
                self.link.rejected(block_hash)
                return n
        return len(written)

    def _fill(self, slots, blocks, hashes: list[int], local: int) -> int:
        """Copies the fetched blocks into their host slots (in a thread); returns how
        many leading ones fit the prompt (parent chain and size) and were copied."""
        filled = 0
        for (block_hash, slot), (got_hash, parent, data) in zip(slots, blocks):
            i = local + filled
            expected_parent = hashes[i - 1] if i > 0 else 0
            if (
                got_hash != block_hash
                or parent != expected_parent
                or len(data) != self.link.block_bytes
            ):
                self.link.rejected(got_hash)
                break
            self.link.engine.host_slot_bytes(slot)[:] = memoryview(data).cast("B")
            filled += 1
        return filled
