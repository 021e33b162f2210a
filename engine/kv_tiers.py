"""The KV cache's tiers below the device pool, as the engine sees them: the
host tier (engine/host_tier.py) and what the shared tier needs of it.

The worker moves shared-tier bytes itself (services, over the network); here
it finds how much of a prompt is already local, and pins host-tier slots for
the worker to read (export) or fill (import) from its own threads: the engine
thread only does the bookkeeping, never a copy. Blocks a KV store on this host
lends (its shared memory, mapped here) skip the host tier: the worker copies
them from its own thread straight into device blocks held for them
(`import_device_begin`, `copy_into_blocks`, `import_device_end`).

What the host tier copies: every block the device frees, at once ("all"), or
the blocks a prompt has hit, when the device evicts them ("reused", a
write-back). The default is "all" when the tier was sized by hand or holds at
least the device pool, "reused" otherwise: a tier smaller than the device
pool would hold only what the device evicted last, and copying every
request's KV there costs the device's steps for little. The shared tier's
writes copy the blocks they need on demand (`export_begin`).
"""

from __future__ import annotations

import torch

from basis.block_hash import cached_prompt_blocks
from engine.block_pool import KVEvents
from engine.config import EngineConfig
from engine.host_memory_ahead import HostMemoryAhead, host_tier_gb, wants_host_tier
from engine.host_tier import HostTier, copy_rows_to_blocks
from engine.kv_cache_manager import KVCacheManager


def backup_policy(config: EngineConfig, host_blocks: int, device_blocks: int) -> str:
    if config.host_kv_backup is not None:
        return config.host_kv_backup
    if config.host_kv_cache_gb is not None or host_blocks >= device_blocks:
        return "all"
    return "reused"


class KVTiers:
    def __init__(
        self,
        config: EngineConfig,
        kv_caches: list,
        kv: KVCacheManager,
        ahead: HostMemoryAhead | None = None,
    ):
        """`ahead`: the host tier's memory, if the runner started allocating it."""
        self.kv = kv
        self.kv_caches = kv_caches
        self.host: HostTier | None = None
        device = kv_caches[0].device
        self._compute_stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        if wants_host_tier(config):
            taken = ahead.take() if ahead is not None else None
            memory = None
            if taken is not None:
                num_blocks, memory = taken
            else:
                num_blocks = HostTier.blocks_for(kv_caches, host_tier_gb(config))
            if num_blocks >= 1:
                self.host = HostTier(kv_caches, num_blocks, memory)
                kv.host = self.host
                policy = backup_policy(config, num_blocks, kv.pool.num_usable_blocks)
                kv.pool.track_newly_free = policy == "all"
                kv.pool.track_evicted = policy == "reused"

    # -- the engine's side -----------------------------------------------------
    def load_pending(self, outside_writes: bool = False) -> None:
        """Before a step: gathers the reused blocks the last allocations evicted (for
        the host tier), then issues the host-to-device copies they need. With
        `outside_writes` (blocks about to be filled from outside the stream, by a
        KV transport), the gather is done before this returns."""
        if self.host is not None:
            evicted = self.kv.pool.take_evicted()
            if evicted:
                self.host.poll(self.kv.pool)  # frees host slots for the backups
                self.host.backup_evicted(evicted, wait=outside_writes)
            self.host.load(self.kv.take_loads())

    def housekeeping(self) -> bool:
        """Backs up what just became free; finishes copies that are done. True when
        device blocks were let go."""
        if self.host is None:
            return False
        pool = self.kv.pool
        before = pool.num_free_blocks
        self.host.poll(pool)  # frees host slots for the backups below
        if self.host.backup(pool.take_newly_free(), pool):
            self.host.poll(pool)  # on CPU they are done already
        return pool.num_free_blocks != before

    def drain_events(self) -> KVEvents:
        events = self.kv.pool.drain_events()
        if self.host is not None:
            host = self.host.pool.drain_events()
            events.host_stored, events.host_removed = host.stored, host.removed
        return events

    def snapshot(self) -> tuple[list[int], list[int]]:
        """Every hash cached on the device and in the host tier, with the events
        not yet drained dropped (the snapshot includes them)."""
        self.drain_events()
        host = self.host.pool.cached_hashes() if self.host is not None else []
        return self.kv.pool.cached_hashes(), host

    def close(self) -> None:
        if self.host is not None:
            self.host.poll(self.kv.pool, wait=True)
            self.host.close()
        self.host = self.kv.host = None

    # -- the shared tier's side ---------------------------------------------------
    def cached_prefix_blocks(
        self, prompt_ids: list[int], namespace: str = "", public_tokens: int = 0
    ) -> int:
        """How many leading full blocks of a prompt the device or host tier holds."""
        count = 0
        for h in cached_prompt_blocks(prompt_ids, self.kv.block_size, namespace, public_tokens):
            on_device = self.kv.pool.lookup(h) is not None
            if not on_device and (self.host is None or self.host.pool.lookup(h) is None):
                break
            count += 1
        return count

    def peek_prefix_blocks(self, hashes: list[int]) -> int:
        """How many leading `hashes` the device or host tier holds, read without
        changing anything (no LRU move): membership tests only, so any thread may
        call it; the answer may be a step old."""
        device = self.kv.pool
        host = self.host.pool if self.host is not None else None
        count = 0
        for h in hashes:
            if device.lookup(h) is None and (host is None or not host.holds(h)):
                break
            count += 1
        return count

    def peek_device_prefix(self, hashes: list[int]) -> int:
        """How many leading `hashes` the device holds (like `peek_prefix_blocks`)."""
        count = 0
        for h in hashes:
            if self.kv.pool.lookup(h) is None:
                break
            count += 1
        return count

    def import_device_begin(self, hashes: list[int], start: int, keep_free: int) -> list[int]:
        """Device blocks to fill from outside for `hashes[start:]`, held (unreadable)
        until `import_device_end`: none unless the device holds `hashes[:start]`
        (a prefix continues on the device or not at all); at most as many as leave
        `keep_free` blocks free, stopping at a hash the device holds already."""
        pool = self.kv.pool
        if self.peek_device_prefix(hashes[:start]) < start:
            return []
        want = 0
        for h in hashes[start:]:
            if pool.lookup(h) is not None:
                break
            want += 1
        # the prefix the blocks continue is held meanwhile: taking blocks never evicts it
        prefix = [pool.lookup(h) for h in hashes[:start]]
        pool.touch(prefix)
        try:
            count = max(0, min(want, pool.num_free_blocks - keep_free))
            return [b.block_id for b in pool.allocate(count)] if count else []
        finally:
            pool.free(prefix[::-1])

    def copy_into_blocks(self, rows: list, block_ids: list[int]):
        """Copies rows ([layers, *block] tensors in host memory) into the held device
        blocks, from the caller's thread; returns a function that waits until they
        are done. On CUDA the copies go on the compute stream (after the work queued
        there, like the host tier's loads), whose memory pool holds what the steps
        freed: a stream of its own would have to allocate fresh staging memory from
        a device the KV cache has filled."""
        device = self.kv_caches[0].device
        if device.type != "cuda":
            copy_rows_to_blocks(rows, block_ids, self.kv_caches)
            return lambda: None
        with torch.cuda.stream(self._compute_stream):
            copy_rows_to_blocks(rows, block_ids, self.kv_caches)
            done = torch.cuda.Event()
            done.record(self._compute_stream)
        return done.synchronize

    def import_device_end(self, block_ids: list[int], hashes: list[int], filled: int) -> None:
        """The first `filled` held blocks hold `hashes` (cached, free, found by the
        next prompt like any device hit); the rest are let go empty."""
        pool = self.kv.pool
        blocks = [pool.blocks[i] for i in block_ids]
        for block, block_hash in zip(blocks[:filled], hashes):
            if pool.lookup(block_hash) is None:
                pool.cache_block(block, block_hash)
        pool.free(blocks[::-1])  # the tail is evicted first

    def export_begin(self, hashes: list[int]) -> list[tuple[int, int]]:
        """(hash, host slot) of the leading `hashes` readable in the host tier, each
        slot pinned (never reused) until `export_end`; stops at the first one that
        is not there yet, and starts copying the device's blocks of the rest."""
        out = []
        if self.host is None:
            return out
        # copies an earlier call started become readable (an idle engine polls nothing)
        self.host.poll(self.kv.pool)
        for h in hashes:
            slot = self.host.pool.lookup(h)
            if slot is None:
                break
            self.host.pool.pin(slot)
            out.append((h, slot))
        # The rest that are still on the device go to the host now (a side-stream copy
        # that a later call finds done).
        on_device = []
        for h in hashes[len(out) :]:
            block = self.kv.pool.lookup(h)
            if block is None:
                break
            on_device.append(block)
        if on_device and self.host.backup(on_device, self.kv.pool):
            self.host.poll(self.kv.pool)  # on CPU they are done already
        return out

    def export_end(self, slots: list[int]) -> None:
        for slot in slots:
            self.host.pool.unpin(slot)

    def import_begin(self, hashes: list[int]) -> list[tuple[int, int]]:
        """(hash, host slot) to fill for the leading `hashes`, each slot held until
        `import_end` (unreadable until then); stops at a hash already held here or
        when no slot is free."""
        out = []
        if self.host is None:
            return out
        for h in hashes:
            slot = self.host.pool.begin_store(h)
            if slot is None:
                break
            out.append((h, slot))
        return out

    def import_end(self, slots: list[int], filled: int) -> None:
        """The first `filled` slots hold their blocks now; the rest are emptied."""
        for i, slot in enumerate(slots):
            self.host.pool.end_store(slot, ok=i < filled)

    def import_blocks(self, blocks: list[tuple[int, bytes]]) -> int:
        """Puts verified blocks, (hash, bytes), into the host tier; returns how many
        it took (a prompt's admission then loads them like any host hit)."""
        if self.host is None:
            return 0
        taken = 0
        for block_hash, data in blocks:
            if not self.host.import_block(block_hash, data):
                break
            taken += 1
        return taken

    def export_blocks(self, hashes: list[int]) -> list[bytes]:
        """The bytes of the leading blocks of `hashes` still held here."""
        if self.host is None:
            return []
        out = []
        for h in hashes:
            data = self.host.export_block(h, self.kv.pool.lookup(h))
            if data is None:
                break
            out.append(data)
        return out

    @property
    def block_bytes(self) -> int:
        return sum(c[0].numel() * c.element_size() for c in self.kv_caches)
