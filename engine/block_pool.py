"""The pool of KV cache blocks: ref counts, the free queue and the prefix-hash map.

Only this module changes those three. A block freed by every sequence stays
in the hash map (its contents are still valid) and joins the back of the free
queue; new allocations take from the front, so cached blocks are evicted
least-recently-used. Block 0 is a null block that is never handed out: padded
rows of a batch write their keys there. Blocks never used yet are made when first
handed out, before any block freed (a pool of many blocks costs nothing to set up).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    reused: bool = False  # a prompt has hit it since it was cached


@dataclass(slots=True)
class KVEvents:
    """Blocks that entered or left the prefix cache since the last drain."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    host_stored: list[int] = field(default_factory=list)  # the host tier's, when there is one
    host_removed: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.host_stored or self.host_removed)

    def extend(self, other: KVEvents) -> None:
        self.stored.extend(other.stored)
        self.removed.extend(other.removed)
        self.host_stored.extend(other.host_stored)
        self.host_removed.extend(other.host_removed)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # every block handed out so far, by id: blocks `len(blocks)`.. have never been
        # used and are made when first allocated (a pool of many blocks costs nothing
        # to set up)
        self.blocks = [KVBlock(0)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1
        # block_id -> block, oldest first: the blocks used before with ref_cnt == 0; the
        # ones never used stand before them, in id order
        self._free: OrderedDict[int, KVBlock] = OrderedDict()
        self._cached: dict[int, KVBlock] = {}
        self.events = KVEvents()
        # Blocks that became free while cached, for the host tier to back up (kept only
        # while one is attached).
        self.track_newly_free = False
        # Or, with `track_evicted`: reused blocks being evicted, for a write-back.
        self.track_evicted = False
        self._evicted: list[tuple[int, int]] = []  # (block id, hash)
        self._newly_free: list[KVBlock] = []

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - len(self.blocks)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def allocate(self, count: int) -> list[KVBlock]:
        """Takes `count` blocks from the front of the free queue, evicting their cached contents."""
        if count > self.num_free_blocks:
            raise ValueError(f"asked for {count} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(count):
            if len(self.blocks) < self.num_blocks:  # one never used
                block = KVBlock(len(self.blocks))
                self.blocks.append(block)
            else:
                _, block = self._free.popitem(last=False)
                if self.track_evicted and block.reused and block.block_hash is not None:
                    self._evicted.append((block.block_id, block.block_hash))
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock], hit: bool = False) -> None:
        """Takes one more reference on each block (a prefix hit, with `hit`, or a fork)."""
        for block in blocks:
            block.reused = block.reused or hit
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drops one reference from each; blocks reaching zero join the back of the free queue
        in the order given (callers pass a sequence's tail first, so it is evicted first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if self.track_newly_free and block.block_hash is not None:
                    self._newly_free.append(block)

    def cache_block(self, block: KVBlock, block_hash: int) -> None:
        """Publishes a full block under its chained hash so later prompts can reuse it."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # an equal block is already cached; this copy stays private
        block.block_hash = block_hash
        self._cached[block_hash] = block
        self.events.stored.append(block_hash)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            self.events.removed.append(block.block_hash)
        block.block_hash = None
        block.reused = False

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block; only possible while no block is in use."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in list(self._cached.values()):
            self._evict(block)
        return True

    def cached_hashes(self) -> list[int]:
        return list(self._cached)

    def take_newly_free(self) -> list[KVBlock]:
        """Cached blocks freed since the last call that are still cached now."""
        blocks, self._newly_free = self._newly_free, []
        return [b for b in blocks if b.ref_cnt == 0 and b.block_hash is not None]

    def take_evicted(self) -> list[tuple[int, int]]:
        """(block id, hash) of the reused blocks evicted since the last call: their
        contents stay valid until the next step runs."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def drain_events(self) -> KVEvents:
        events, self.events = self.events, KVEvents()
        return events
