"""The host tier's block bookkeeping: which host slot holds which block hash,
least-recently-used order, and pins on slots a copy is using.

Every slot is either free, cached (holds a block's KV under its hash) or
pinned (a copy into or out of it is in flight). New slots come from the
front of the LRU queue (free slots first, then the least recently used
cached ones, whose hash is evicted); a lookup or a store moves a slot to the
back. Events say which hashes entered and left the tier. Slots never used yet
are not listed: they stand, in order, right behind the emptied ones at the
queue's front (a tier of millions of slots costs nothing to set up).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class HostEvents:
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)


class HostBlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the host tier needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        # slot -> its hash (None: empty), oldest first; holds exactly the unpinned slots
        # used so far (the emptied ones at the front), then come slots `_fresh`.. on
        self._lru: OrderedDict[int, int | None] = OrderedDict()
        self._fresh = 0  # the first slot never used
        self._slot_of: dict[int, int] = {}  # hash -> slot (cached or being written)
        self._hash_of: dict[int, int] = {}  # slot -> hash, for every slot holding one
        self._pins: dict[int, int] = {}  # slot -> pin count
        self._writing: set[int] = set()  # slots whose hash is not readable yet
        self.events = HostEvents()
        self.num_evicted = 0  # cached blocks pushed out for new ones, so far
        self.num_refused = 0  # stores refused with every slot pinned, so far

    @property
    def num_cached(self) -> int:
        return len(self._slot_of) - len(self._writing)

    def lookup(self, block_hash: int) -> int | None:
        """The slot holding `block_hash` (readable), moved to the back of the LRU."""
        slot = self._slot_of.get(block_hash)
        if slot is None or slot in self._writing:
            return None
        if slot in self._lru:
            self._lru.move_to_end(slot)
        return slot

    def holds(self, block_hash: int) -> bool:
        """Readable here (like `lookup`, but changes nothing: safe from any thread)."""
        slot = self._slot_of.get(block_hash)
        return slot is not None and slot not in self._writing

    def contains(self, block_hash: int) -> bool:
        """Held or being written (so a second copy of it is not started)."""
        return block_hash in self._slot_of

    def begin_store(self, block_hash: int) -> int | None:
        """A pinned slot to copy `block_hash` into, evicting the least recently used
        block if need be; None when it is already here or every slot is pinned."""
        if block_hash in self._slot_of:
            self.lookup(block_hash)
            return None
        slot = self._take_slot()
        if slot is None:
            self.num_refused += 1
            return None
        old = self._lru.pop(slot)
        if old is not None:
            self.num_evicted += 1
            del self._slot_of[old]
            del self._hash_of[slot]
            self.events.removed.append(old)
        self._slot_of[block_hash] = slot
        self._hash_of[slot] = block_hash
        self._writing.add(slot)
        self._pins[slot] = 1
        return slot

    def _take_slot(self) -> int | None:
        """The front of the queue (left in it): an emptied slot, else one never used
        (listed now), else the least recently used; None when every slot is pinned."""
        first = next(iter(self._lru), None)
        if (first is None or self._lru[first] is not None) and self._fresh < self.num_blocks:
            first = self._fresh
            self._fresh += 1
            self._lru[first] = None
        return first

    def end_store(self, slot: int, ok: bool = True) -> None:
        """The copy into `slot` finished (or failed: the slot is emptied)."""
        block_hash = self._hash_of[slot]
        self._writing.discard(slot)
        if ok:
            self.events.stored.append(block_hash)
        else:
            del self._slot_of[block_hash]
            del self._hash_of[slot]
        self.unpin(slot)

    def pin(self, slot: int) -> None:
        """Keeps `slot` from being reused while a copy reads it."""
        if self._pins.get(slot, 0) == 0:
            self._lru.pop(slot)
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        count = self._pins[slot] - 1
        if count:
            self._pins[slot] = count
            return
        del self._pins[slot]
        block_hash = self._hash_of.get(slot)
        self._lru[slot] = block_hash  # back of the queue: just used
        if block_hash is None:
            self._lru.move_to_end(slot, last=False)  # an empty slot is reused first

    def drain_events(self) -> HostEvents:
        events, self.events = self.events, HostEvents()
        return events

    def cached_hashes(self) -> list[int]:
        return [h for h, s in self._slot_of.items() if s not in self._writing]
