"""Per-sequence block tables over the block pool, with automatic prefix caching
across two tiers: the device pool, and (when attached) the host tier.

The scheduler sees only this API: find a sequence's cached prefix, allocate
slots for the tokens it will compute, fork a sequence from another, free. A
prefix found in the host tier gets device blocks like new tokens do, and the
copies that fill them are queued for the engine to issue before the step
(`take_loads`); blocks that become free while still cached go to the host
tier in the background (`take_newly_free`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from basis.block_hash import block_namespace, cached_prompt_blocks, hash_block_tokens
from engine.block_pool import BlockPool, KVBlock
from engine.sequence import Sequence


@dataclass(slots=True)
class CachedPrefix:
    """A sequence's longest cached prefix: device blocks, then host-tier slots."""

    blocks: list[KVBlock] = field(default_factory=list)
    host_slots: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.blocks) + len(self.host_slots)


@dataclass(slots=True)
class CacheStats:
    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    usage: float
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    fragmentation: float
    host_hit_tokens: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        if self.prefix_queried_tokens == 0:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_queried_tokens


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.tables: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[int]] = {}
        self._committed: dict[str, int] = {}  # seq_id -> leading blocks already published
        self._ids: dict[str, list[int]] = {}  # seq_id -> block ids of its table
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.host_hit_tokens = 0
        self.host = None  # the engine attaches its HostTier, if it has one
        self._loads: list[tuple[int, int]] = []  # (host slot, device block id) to copy

    # -- queries -------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, seq: Sequence) -> list[int]:
        """The sequence's block table as ids (kept in step with `tables`; do not modify)."""
        return self._ids.get(seq.seq_id, [])

    def block_hashes(self, seq: Sequence) -> list[int]:
        """Chained hashes of the sequence's full blocks (computed lazily, extended as it grows)."""
        hashes = self._hashes.setdefault(seq.seq_id, [])
        tokens, size = seq.all_token_ids, self.block_size
        if not hashes:  # a prompt's blocks in one pass
            hashes += cached_prompt_blocks(tokens, size, seq.namespace, seq.public_tokens)
        while (len(hashes) + 1) * size <= len(tokens):
            start = len(hashes) * size
            parent = hashes[-1] if hashes else None
            ns = block_namespace(len(hashes), size, seq.namespace, seq.public_tokens)
            hashes.append(hash_block_tokens(parent, tokens[start : start + size], ns))
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """The longest run of cached blocks matching the sequence's start: on the
        device, then continued in the host tier.

        At least one token is always left to compute, so the model produces
        logits for the last prompt position.
        """
        found = CachedPrefix()
        if not self.enable_prefix_caching:
            return found
        limit = (seq.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(seq)[:limit]
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            found.blocks.append(block)
        if self.host is not None:
            for block_hash in hashes[len(found.blocks) :]:
                slot = self.host.pool.lookup(block_hash)
                if slot is None:
                    break
                found.host_slots.append(slot)
        return found

    # -- changes -------------------------------------------------------------
    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, cached: CachedPrefix | None = None
    ) -> bool:
        """Makes room for `num_new_tokens` more tokens of `seq`.

        `cached` is given when a sequence holding no blocks is admitted: the
        prefix found by `find_cached_prefix` (possibly empty). On success the
        sequence holds that prefix and enough blocks; on failure nothing changed.
        """
        table = self.tables.get(seq.seq_id, [])
        if cached is not None and table:
            raise RuntimeError("a cached prefix can only start an empty block table")
        device = cached.blocks if cached is not None else []
        if cached:
            num_computed = len(cached) * self.block_size
        else:
            num_computed = seq.num_computed_tokens
        # host-tier hits need device blocks like new tokens do
        need = self.blocks_needed(num_computed + num_new_tokens) - len(table) - len(device)
        reclaimable = sum(1 for b in device if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - reclaimable:
            return False
        if cached is not None:
            self.pool.touch(device, hit=True)
            table = list(device)
            seq.num_computed_tokens = num_computed
            seq.num_cached_tokens = num_computed
            if self.enable_prefix_caching:
                self.prefix_queried_tokens += seq.num_tokens
                self.prefix_hit_tokens += num_computed
                self.host_hit_tokens += len(cached.host_slots) * self.block_size
        if need > 0:
            new = self.pool.allocate(need)
            table = table + new
            for slot, block in zip(cached.host_slots if cached else (), new):
                self.host.pool.pin(slot)  # until the copy into `block` is done
                self._loads.append((slot, block.block_id))
        self.tables[seq.seq_id] = table
        if cached is not None or seq.seq_id not in self._ids:
            self._ids[seq.seq_id] = [b.block_id for b in table]
        elif need > 0:
            self._ids[seq.seq_id].extend(b.block_id for b in new)
        return True

    def take_loads(self) -> list[tuple[int, int]]:
        """The host-to-device copies the last allocations need, (slot, block id);
        the engine issues them before the step that reads those blocks."""
        loads, self._loads = self._loads, []
        return loads

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares the parent's full prompt blocks and recomputes the rest."""
        shared_blocks = (child.num_tokens - 1) // self.block_size
        shared = self.tables[parent.seq_id][:shared_blocks]
        self.pool.touch(shared)
        self.tables[child.seq_id] = list(shared)
        self._ids[child.seq_id] = [b.block_id for b in shared]
        child.num_computed_tokens = shared_blocks * self.block_size
        child.num_cached_tokens = child.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        table = self.tables.pop(seq.seq_id, None)
        self._hashes.pop(seq.seq_id, None)
        self._committed.pop(seq.seq_id, None)
        self._ids.pop(seq.seq_id, None)
        if table:
            self.pool.free(list(reversed(table)))

    def commit(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Publishes the sequence's fully computed blocks to the prefix cache.

        Called after the model ran, so a block is shared only once its keys and
        values are really in it; `num_computed` (default: the sequence's count)
        bounds the tokens a finished step wrote.
        """
        if not self.enable_prefix_caching:
            return
        if num_computed is None:
            num_computed = seq.num_computed_tokens
        table = self.tables.get(seq.seq_id)
        done = self._committed.get(seq.seq_id, 0)
        if not table or num_computed // self.block_size <= done:
            return  # no newly full block (the common decode step)
        hashes = self.block_hashes(seq)
        full = min(num_computed // self.block_size, len(hashes), len(table))
        for i in range(done, full):
            self.pool.cache_block(table[i], hashes[i])
        self._committed[seq.seq_id] = max(done, full)

    # -- reporting -----------------------------------------------------------
    def stats(self, num_tokens_of: dict[str, int] | None = None) -> CacheStats:
        """`num_tokens_of` maps seq_id to tokens it keeps in the cache, for fragmentation."""
        fill: dict[int, int] = {}
        for seq_id, table in self.tables.items():
            held = (num_tokens_of or {}).get(seq_id, len(table) * self.block_size)
            for i, block in enumerate(table):
                used = min(self.block_size, max(0, held - i * self.block_size))
                fill[block.block_id] = max(fill.get(block.block_id, 0), used)
        allocated = len(fill) * self.block_size
        unused = allocated - sum(fill.values())
        used_blocks = self.pool.num_usable_blocks - self.pool.num_free_blocks
        return CacheStats(
            num_blocks=self.pool.num_usable_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            num_used_blocks=used_blocks,
            usage=self.pool.usage(),
            prefix_queried_tokens=self.prefix_queried_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            fragmentation=unused / allocated if allocated else 0.0,
            host_hit_tokens=self.host_hit_tokens,
        )
