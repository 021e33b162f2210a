"""A worker's writes to the shared tier under its policy (see shared_kv.py): the
chosen blocks wait in a bounded queue (`max_pending_bytes`); the blocks of a
write that do not fit (its tail) are dropped and counted, never waited for. A
queued write waits (briefly) until its blocks are in the host tier, then puts
them while their slots are pinned: a store on this host reads them out of the
tier's shared memory (PutFrom), one elsewhere gets copies with checksums made
in a thread."""

from __future__ import annotations

import asyncio
import logging

from basis.block_hash import PUBLIC_NAMESPACE, cached_prompt_blocks
from services.common import metrics
from services.common.kv_checksum import block_checksum
from services.worker.shared_kv_link import SharedKvLink

logger = logging.getLogger("services.worker.shared_kv")
_EXPORT_TRIES = 20  # a freed block reaches the host tier a step or two after its request
_EXPORT_WAIT = 0.025  # seconds between tries


class SharedKvWrites:
    def __init__(self, link: SharedKvLink, policy: str, max_pending_bytes: int):
        self.link = link
        self.policy = policy
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self._queued: set[int] = set()  # in a write queued or in flight
        self._tasks: set[asyncio.Task] = set()

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
            hashes = cached_prompt_blocks(prompt_ids, self.link.block_size, tenant, public_tokens)
            hashes = hashes[: cached_tokens // self.link.block_size]
        else:
            tokens = prompt_ids if self.policy == "prefix" else prompt_ids + output_ids
            hashes = cached_prompt_blocks(tokens, self.link.block_size, tenant, public_tokens)
        todo = [
            (i, h)
            for i, h in enumerate(hashes)
            if h not in self.link.known and h not in self._queued
        ]
        if not todo:
            return
        # the leading blocks that fit (a prompt's head is worth the most: every longer
        # prompt sharing it reads it); the rest are dropped and counted
        room = max(0, self.max_pending_bytes - self.pending_bytes) // self.link.block_bytes
        if room < len(todo):
            self._dropped(len(todo) - room, "queue_full")
            todo = todo[:room]
            if not todo:
                return
        nbytes = len(todo) * self.link.block_bytes
        self._pending(nbytes)
        self._queued.update(h for _, h in todo)  # a later request for them waits for this one
        public = public_tokens // self.link.block_size
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
            self._pending(-nbytes)
            self._queued.difference_update(h for _, h in todo)

    def _pending(self, nbytes: int) -> None:
        self.pending_bytes += nbytes
        metrics.KV_SHARED_PENDING_BYTES.labels(worker=self.link.worker_id).set(self.pending_bytes)

    async def _write_blocks(self, todo, parents, tenant: str, public_blocks: int) -> None:
        """Waits (briefly) until the blocks are in the host tier, then puts them while
        their slots are pinned: the store reads them out of our shared memory, or
        (another host) we copy them out with their checksums in a thread."""
        hashes = [h for _, h in todo]
        index = {h: i for i, h in todo}
        done = stored = 0
        for attempt in range(_EXPORT_TRIES):
            pinned = await self.link.engine.export_begin(hashes[done:])
            if pinned:
                try:
                    stored += await self._put_pinned(pinned, index, parents, tenant, public_blocks)
                finally:
                    await self.link.engine.export_end([s for _, s in pinned])
                done += len(pinned)
            if done == len(hashes) or attempt == _EXPORT_TRIES - 1:
                break
            await asyncio.sleep(_EXPORT_WAIT)
        if done < len(hashes):
            self._dropped(len(hashes) - done, "not_local")
        nbytes = stored * self.link.block_bytes
        self.link.stats.written_blocks += stored
        self.link.stats.written_bytes += nbytes
        metrics.KV_SHARED_WRITTEN_BLOCKS.labels(worker=self.link.worker_id).inc(stored)
        metrics.KV_SHARED_BYTES.labels(worker=self.link.worker_id, direction="out").inc(nbytes)

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
            if self.link.region is not None:
                refs = [(h, parents[index[h]], slot * self.link.block_bytes) for h, slot in part]
                done = await self.link.client.put_from(
                    owner, self.link.region, self.link.block_bytes, refs
                )
                if done is None:
                    self.link.no_region()
            if done is None:
                copies = await asyncio.to_thread(self._copy_out, part)
                blocks = [(h, parents[index[h]], data, c) for h, data, c in copies]
                done = await self.link.client.put(owner, blocks)
            if done == len(part):
                for h, _ in part:
                    self.link.remember(h)
            else:
                self._dropped(len(part) - done, "store")
            stored += done
        return stored

    def _copy_out(self, pinned: list[tuple[int, int]]) -> list[tuple[int, bytes, int]]:
        out = []
        for block_hash, slot in pinned:
            data = self.link.engine.host_slot_bytes(slot).tobytes()
            out.append((block_hash, data, block_checksum(data)))
        return out

    def _dropped(self, count: int, reason: str) -> None:
        self.link.stats.dropped_blocks += count
        metrics.KV_SHARED_DROPPED_BLOCKS.labels(worker=self.link.worker_id, reason=reason).inc(
            count
        )

    async def drain(self) -> None:
        """Waits for the writes in flight (at shutdown)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
