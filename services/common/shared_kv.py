"""The shared tier as an engine worker uses it, free of gRPC (the KV store
client is handed in): before a prompt runs, the blocks it lacks locally that
the shared tier holds are fetched, checked, and put into the engine's host
tier, where admission finds them; after a request, blocks are written down
under a policy:

- `none`: nothing is written;
- `selective` (the default): the prompt's blocks that it found cached, i.e. a
  block goes down once it is reused (random traffic writes nothing);
- `prefix`: every full block of the prompt (a later request with this
  prefix, on any worker, skips it);
- `all`: also the blocks of the generated tokens (the next turn of a
  conversation, whose prompt holds this answer, skips it too).

No byte passes through the engine's thread or waits on its steps: the engine
pins host-tier slots (its pinned copies of blocks that left the device). A KV
store on this host reads those slots out of the tier's shared memory (PutFrom)
and writes fetched blocks into it (GetInto), so no block's bytes pass through
this process at all; a store elsewhere gets them by value, copied and
checksummed in a thread. Writes wait in a bounded queue (`max_pending_bytes`):
the blocks of a write that do not fit (its tail) are dropped and counted, never
waited for. A block's hash is what it holds (chained over the prompt and salted
with the tenant), so a fetched block is used only under the hash the prompt
asks for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from basis.block_hash import PUBLIC_NAMESPACE, hash_prompt_blocks
from engine import AsyncLLM
from services.common import metrics
from services.common.kv_checksum import block_checksum
from services.common.kv_index import SHARED, SHARED_HOLDER, KvIndex
from services.common.telemetry import tracer
from services.common.worker_config import WRITE_THROUGH

_VERIFY_POOL = ThreadPoolExecutor(4, thread_name_prefix="kv-verify")

logger = logging.getLogger(__name__)
_tracer = tracer("yinian.kv")
_REMEMBERED = 1 << 16  # hashes known to be in the store, not written again
_EXPORT_TRIES = 20  # a freed block reaches the host tier a step or two after its request
_EXPORT_WAIT = 0.025  # seconds between tries


@dataclass(slots=True)
class SharedKvStats:
    fetched_blocks: int = 0
    fetched_bytes: int = 0
    fetch_seconds: float = 0.0
    rejected_blocks: int = 0  # came back but failed a check here
    written_blocks: int = 0
    written_bytes: int = 0
    dropped_blocks: int = 0  # chosen by the policy, not written (queue full, gone, refused)


class SharedKv:
    def __init__(
        self,
        engine: AsyncLLM,
        client,
        worker_id: str,
        policy: str = "selective",
        max_pending_bytes: int = 2048 << 20,
        index: KvIndex | None = None,
    ):
        if policy not in WRITE_THROUGH:
            raise ValueError(f"write-through policy must be one of {WRITE_THROUGH}, got {policy!r}")
        self.engine = engine
        self.client = client
        self.worker_id = worker_id
        self.policy = policy
        self.max_pending_bytes = max_pending_bytes
        self.block_size = engine.facts.block_size
        self.block_bytes = engine.facts.kv_block_bytes
        self.stats = SharedKvStats()
        self.pending_bytes = 0
        # What the shared tier holds, from its events on NATS (the worker feeds it): a
        # prompt whose first block is not there costs no call to the store at all.
        self.index = index
        # The host tier's shared memory, which a KV store on this host reads and fills
        # itself (None: blocks go by value, through this process).
        self.region = engine.host_region
        self._written: OrderedDict[int, None] = OrderedDict()
        self._queued: set[int] = set()  # in a write queued or in flight
        self._tasks: set[asyncio.Task] = set()

    # -- reads -------------------------------------------------------------------
    async def introduce(self) -> None:
        """Names this worker's host tier to the store ahead of any block, so that it
        maps the memory now and not on the first fetch (a GetInto of no blocks)."""
        if self.region is not None:
            if await self.client.map_region(self.region, self.block_bytes) is None:
                self._no_region()

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
        start = time.monotonic()
        if self.index is not None and self.index.synced(SHARED_HOLDER):
            # What the tier's events say it holds, against what is here already: a
            # prompt the tier cannot extend costs no call to the store, nor a wait for
            # the engine's next step.
            if not self.index.holds_any(SHARED_HOLDER, SHARED, hashes):
                return 0
            local = self.engine.peek_cached_prefix(hashes)
            if self.index.matched_blocks(SHARED_HOLDER, hashes, (SHARED,)) <= local:
                return 0
        else:
            local = None
        shared = await self.client.lookup(tenant, hashes)
        if shared == 0:
            return 0
        if local is None:  # not known yet: ask the engine, between its steps
            head = prompt_ids[: limit * self.block_size]
            local = await self.engine.cached_prefix_blocks(head, tenant, public_tokens)
        if shared <= local:
            return 0
        slots = await self.engine.import_begin(hashes[local:shared])
        if not slots:
            return 0
        filled = 0
        try:
            written = None
            if self.region is not None:
                offsets = [slot * self.block_bytes for _, slot in slots]
                written = await self.client.get_into(
                    tenant, self.region, self.block_bytes, [h for h, _ in slots], offsets
                )
                if written is None:
                    self._no_region()
                else:
                    filled = await asyncio.to_thread(self._verify, slots, written, hashes, local)
            if written is None:
                blocks = await self.client.get(tenant, [h for h, _ in slots])
                filled = await asyncio.to_thread(self._fill, slots, blocks, hashes, local)
        finally:
            await self.engine.import_end([s for _, s in slots], filled)
        seconds = time.monotonic() - start
        nbytes = filled * self.block_bytes
        self.stats.fetched_blocks += filled
        self.stats.fetched_bytes += nbytes
        self.stats.fetch_seconds += seconds
        metrics.KV_SHARED_FETCHED_TOKENS.labels(worker=self.worker_id).inc(filled * self.block_size)
        metrics.KV_SHARED_BYTES.labels(worker=self.worker_id, direction="in").inc(nbytes)
        metrics.KV_SHARED_FETCH_SECONDS.observe(seconds)
        for block_hash, _ in slots[:filled]:
            self._remember(block_hash)
        return filled * self.block_size

    def _verify(self, slots, written, hashes: list[int], local: int) -> int:
        """How many leading blocks the store wrote into their slots fit the prompt
        (parent chain) and hold what their checksum says (read here, in a thread)."""
        # a GiB of blocks is ~60 ms of XXH3 on one core: spread over a few
        sums = list(_VERIFY_POOL.map(
            lambda slot: block_checksum(self.engine.host_slot_bytes(slot)),
            [slot for _, slot in slots[: len(written)]],
        ))  # fmt: skip
        for n, ((block_hash, _), (parent, checksum)) in enumerate(zip(slots, written)):
            i = local + n
            expected_parent = hashes[i - 1] if i > 0 else 0
            if parent != expected_parent or sums[n] != checksum:
                self._rejected(block_hash)
                return n
        return len(written)

    def _rejected(self, block_hash: int) -> None:
        self.stats.rejected_blocks += 1
        metrics.KV_SHARED_REJECTED.labels(worker=self.worker_id).inc()
        logger.warning("shared block %x does not fit this prompt; recomputing", block_hash)

    def _fill(self, slots, blocks, hashes: list[int], local: int) -> int:
        """Copies the fetched blocks into their host slots (in a thread); returns how
        many leading ones fit the prompt (parent chain and size) and were copied."""
        filled = 0
        for (block_hash, slot), (got_hash, parent, data) in zip(slots, blocks):
            i = local + filled
            expected_parent = hashes[i - 1] if i > 0 else 0
            if got_hash != block_hash or parent != expected_parent or len(data) != self.block_bytes:
                self._rejected(got_hash)
                break
            self.engine.host_slot_bytes(slot)[:] = memoryview(data).cast("B")
            filled += 1
        return filled

    # -- writes ------------------------------------------------------------------
    def write_through(
        self,
        prompt_ids: list[int],
        output_ids: list[int],
        tenant: str,
        public_tokens: int = 0,
        cached_tokens: int = 0,
    ) -> None:
        """Queues the request's blocks that the policy chooses (`cached_tokens`: how
        much of the prompt it found cached, for `selective`), written in the
        background; dropped and counted when the queue is full."""
        if self.policy == "none":
            return
        if self.policy == "selective":
            hashes = hash_prompt_blocks(prompt_ids, self.block_size, tenant, public_tokens)
            hashes = hashes[: cached_tokens // self.block_size]
        else:
            tokens = prompt_ids if self.policy == "prefix" else prompt_ids + output_ids
            hashes = hash_prompt_blocks(tokens, self.block_size, tenant, public_tokens)
        todo = [
            (i, h) for i, h in enumerate(hashes) if h not in self._written and h not in self._queued
        ]
        if not todo:
            return
        # the leading blocks that fit (a prompt's head is worth the most: every longer
        # prompt sharing it reads it); the rest are dropped and counted
        room = max(0, self.max_pending_bytes - self.pending_bytes) // self.block_bytes
        if room < len(todo):
            self._dropped(len(todo) - room, "queue_full")
            todo = todo[:room]
            if not todo:
                return
        nbytes = len(todo) * self.block_bytes
        self.pending_bytes += nbytes
        self._queued.update(h for _, h in todo)  # a later request for them waits for this one
        public = public_tokens // self.block_size
        parents = {i: hashes[i - 1] if i else 0 for i, _ in todo}
        task = asyncio.get_running_loop().create_task(
            self._write(todo, parents, tenant, public, nbytes)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write(self, todo, parents, tenant: str, public_blocks: int, nbytes: int) -> None:
        try:
            await self._write_blocks(todo, parents, tenant, public_blocks)
        except RuntimeError:  # the engine shut down meanwhile
            pass
        except Exception:
            logger.exception("shared-tier write failed")
        finally:
            self.pending_bytes -= nbytes
            self._queued.difference_update(h for _, h in todo)

    async def _write_blocks(self, todo, parents, tenant: str, public_blocks: int) -> None:
        """Waits (briefly) until the blocks are in the host tier, then puts them while
        their slots are pinned: the store reads them out of our shared memory, or
        (another host) we copy them out with their checksums in a thread."""
        hashes = [h for _, h in todo]
        index = {h: i for i, h in todo}
        done = stored = 0
        for attempt in range(_EXPORT_TRIES):
            pinned = await self.engine.export_begin(hashes[done:])
            if pinned:
                try:
                    stored += await self._put_pinned(pinned, index, parents, tenant, public_blocks)
                finally:
                    await self.engine.export_end([s for _, s in pinned])
                done += len(pinned)
            if done == len(hashes) or attempt == _EXPORT_TRIES - 1:
                break
            await asyncio.sleep(_EXPORT_WAIT)
        if done < len(hashes):
            self._dropped(len(hashes) - done, "not_local")
        nbytes = stored * self.block_bytes
        self.stats.written_blocks += stored
        self.stats.written_bytes += nbytes
        metrics.KV_SHARED_WRITTEN_BLOCKS.labels(worker=self.worker_id).inc(stored)
        metrics.KV_SHARED_BYTES.labels(worker=self.worker_id, direction="out").inc(nbytes)

    async def _put_pinned(self, pinned, index, parents, tenant: str, public_blocks: int) -> int:
        stored = 0
        # the public prefix's blocks belong to the public namespace, the rest to the tenant
        for owner, part in (
            (PUBLIC_NAMESPACE, [p for p in pinned if index[p[0]] < public_blocks]),
            (tenant, [p for p in pinned if index[p[0]] >= public_blocks]),
        ):
            if not part:
                continue
            done = None
            if self.region is not None:
                refs = [(h, parents[index[h]], slot * self.block_bytes) for h, slot in part]
                done = await self.client.put_from(owner, self.region, self.block_bytes, refs)
                if done is None:
                    self._no_region()
            if done is None:
                copies = await asyncio.to_thread(self._copy_out, part)
                blocks = [(h, parents[index[h]], data, c) for h, data, c in copies]
                done = await self.client.put(owner, blocks)
            if done == len(part):
                for h, _ in part:
                    self._remember(h)
            else:
                self._dropped(len(part) - done, "store")
            stored += done
        return stored

    def _no_region(self) -> None:
        logger.info("the KV store cannot map this worker's host tier (another host?); "
                    "blocks go by value")  # fmt: skip
        self.region = None

    def _copy_out(self, pinned: list[tuple[int, int]]) -> list[tuple[int, bytes, int]]:
        out = []
        for block_hash, slot in pinned:
            data = self.engine.host_slot_bytes(slot).tobytes()
            out.append((block_hash, data, block_checksum(data)))
        return out

    def _dropped(self, count: int, reason: str) -> None:
        self.stats.dropped_blocks += count
        metrics.KV_SHARED_DROPPED_BLOCKS.labels(worker=self.worker_id, reason=reason).inc(count)

    def _remember(self, block_hash: int) -> None:
        self._written[block_hash] = None
        self._written.move_to_end(block_hash)
        if len(self._written) > _REMEMBERED:
            self._written.popitem(last=False)

    async def drain(self) -> None:
        """Waits for the writes in flight (at shutdown)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
