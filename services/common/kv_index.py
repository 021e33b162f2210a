"""Which holder has which KV block, in which tier, from the KV events on NATS.

A holder is a worker (its GPU tier and its host tier) or the shared tier (the
KV store's Redis). Each holder numbers its event batches. A batch marked
`reset` is a full snapshot and replaces what was known of that holder; a gap
in the numbering (a lost message) drops the holder's entries and marks it
for a resync (its answer is a reset batch), so the index may under-report a
holder for a moment but never keeps claiming blocks it lacks.

The scheduler keeps the mesh's one index: for placement, and for
`Scheduler.Holders`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from functools import reduce
from itertools import compress
from operator import or_

from services.common.errors import InvalidRequest

GPU, HOST, SHARED = "gpu", "host", "shared"
TIERS = (GPU, HOST, SHARED)
Counts = tuple[int, int, int]  # a prefix's blocks in the GPU, host and shared tiers
SHARED_HOLDER = "shared"  # the holder id of the shared tier
_BIT_BYTES = bytes.maketrans(b"01", b"\x00\x01")
MAX_BLOCKS_PER_CALL = 16_384  # block hashes in one call (a 256k-token prompt at 16 a block)


def check_block_count(hashes) -> None:
    """InvalidRequest when a call names more blocks than MAX_BLOCKS_PER_CALL."""
    if len(hashes) > MAX_BLOCKS_PER_CALL:
        raise InvalidRequest(f"{len(hashes)} block hashes; at most {MAX_BLOCKS_PER_CALL} per call")


class KvIndex:
    def __init__(self):
        # (holder, tier) -> block hashes; (hash, tier) -> its holders as a bit mask (a
        # bit per holder: `prefix_groups` over a thousand holders costs a few integer
        # operations a block)
        self._blocks: dict[tuple[str, str], set[int]] = defaultdict(set)
        self._masks: dict[tuple[int, str], int] = {}
        self._bit: dict[str, int] = {}  # holder -> its bit (freed when it is forgotten)
        self._names: list[str | None] = []  # bit -> holder
        self._free: list[int] = []  # bits of holders forgotten, given out again
        self.bit_epoch = 0  # counts bits freed: a mask of holders kept elsewhere is stale
        self._last_event: dict[str, int] = {}
        self.needs_resync: set[str] = set()
        self.gaps = 0

    # -- events --------------------------------------------------------------
    def apply(
        self,
        holder: str,
        event_id: int,
        changes: dict[str, tuple[list[int], list[int]]],
        reset: bool = False,
    ) -> bool:
        """Applies one numbered batch: `changes` maps a tier to (stored, removed).
        Returns False when the batch revealed a gap (the holder needs a resync)."""
        last = self._last_event.get(holder)
        if reset:
            self.forget(holder)
            self.needs_resync.discard(holder)
        elif last is None or event_id != last + 1:
            if last is not None:
                self.gaps += 1
            self.forget(holder)
            self.needs_resync.add(holder)
            self._last_event[holder] = event_id
            return False
        elif holder in self.needs_resync:
            self._last_event[holder] = event_id
            return False  # in order, but what came before the gap is still missing
        self._last_event[holder] = event_id
        for tier, (stored, removed) in changes.items():
            key = (holder, tier)
            blocks = self._blocks[key]
            bit, masks = self.bit_of(holder), self._masks
            for h in stored:
                masks[(h, tier)] = masks.get((h, tier), 0) | bit
                blocks.add(h)
            for h in removed:
                self._drop(h, key)
                blocks.discard(h)
        return True

    def forget(self, holder: str) -> None:
        """Drops everything known of `holder` (gone, restarted, or out of sync)."""
        for tier in TIERS:
            for h in self._blocks.pop((holder, tier), ()):
                self._drop(h, (holder, tier))
        self._last_event.pop(holder, None)
        bit = self._bit.pop(holder, None)
        if bit is not None:  # no mask holds it now: another holder may have it
            self._names[bit.bit_length() - 1] = None
            self._free.append(bit)
            self.bit_epoch += 1

    def bit_of(self, holder: str) -> int:
        """The holder's bit in this index's masks (given one if it has none); it
        stays the holder's until `bit_epoch` changes."""
        bit = self._bit.get(holder)
        if bit is None:
            if self._free:
                bit = self._free.pop()
                self._names[bit.bit_length() - 1] = holder
            else:
                bit = 1 << len(self._names)
                self._names.append(holder)
            self._bit[holder] = bit
        return bit

    def _drop(self, h: int, key: tuple[str, str]) -> None:
        mask = self._masks.get((h, key[1]), 0) & ~self._bit[key[0]]
        if mask:
            self._masks[(h, key[1])] = mask
        else:
            self._masks.pop((h, key[1]), None)

    def holder_names(self, mask: int) -> set[str]:
        names = self._names
        if not mask:
            return set()
        if mask & (mask - 1) == 0:  # one holder (the common case of a history)
            return {names[mask.bit_length() - 1]}
        # bit i at position i, as bytes 0 (not held) or 1 (held)
        bits = bin(mask)[:1:-1].encode().translate(_BIT_BYTES)
        return set(compress(names, bits))

    # -- queries -------------------------------------------------------------
    def holds_any(self, holder: str, tier: str, block_hashes) -> bool:
        blocks = self._blocks.get((holder, tier))
        return bool(blocks) and any(h in blocks for h in block_hashes)

    def synced(self, holder: str) -> bool:
        """Whether the index follows `holder` now (a batch came, and no gap since)."""
        return holder in self._last_event and holder not in self.needs_resync

    def matched_blocks(self, holder: str, block_hashes, tiers=(GPU,)) -> int:
        """How many leading blocks of a prompt `holder` has in any of `tiers`."""
        sets = [self._blocks.get((holder, t)) for t in tiers]
        sets = [s for s in sets if s]
        count = 0
        for h in block_hashes:
            if not any(h in s for s in sets):
                break
            count += 1
        return count

    def prefix_by_tier(self, holder: str, block_hashes) -> list[str]:
        """For each leading block the holder (or the shared tier) has, the cheapest
        tier it is in: GPU before host before shared; stops at the first miss."""
        out, masks = [], self._masks
        bit, shared_bit = self._bit.get(holder, 0), self._bit.get(SHARED_HOLDER, 0)
        for h in block_hashes:
            if masks.get((h, GPU), 0) & bit:
                out.append(GPU)
            elif masks.get((h, HOST), 0) & bit:
                out.append(HOST)
            elif masks.get((h, SHARED), 0) & shared_bit:
                out.append(SHARED)
            else:
                break
        return out

    def prefix_groups(self, block_hashes, holders) -> list[tuple[Counts, set[str]]]:
        """`holders` grouped by what `prefix_by_tier` gives each for this prompt, as
        ((GPU, host, shared) block counts, holders): one walk over the prompt's
        blocks for all of them, on bit masks (a bit per holder), so a prefix that a
        thousand workers hold costs a few integer operations a block."""
        try:
            active = reduce(or_, map(self._bit.__getitem__, holders), 0)
        except KeyError:  # a holder the index never heard of: give it its bit
            active = reduce(or_, map(self.bit_of, holders), 0)
        return [(counts, self.holder_names(mask))
                for counts, mask in self.prefix_group_masks(block_hashes, active)]  # fmt: skip

    def prefix_group_masks(self, block_hashes, active: int) -> list[tuple[Counts, int]]:
        """`prefix_groups` for the holders whose bits are in `active` (a mask kept by
        the caller), each group as a mask."""
        masks, shared_bit = self._masks, self._bit.get(SHARED_HOLDER, 0)
        extra: dict[int, list[int]] = {}  # bit -> [host, shared] of its own
        bulk: list[int] = []  # depths where every active holder read the shared tier
        ended: list[tuple[int, int]] = []  # (depth, holders whose prefix ends there)
        depth = 0
        for depth, h in enumerate(block_hashes):
            gpu = masks.get((h, GPU), 0)
            host = masks.get((h, HOST), 0)
            if not masks.get((h, SHARED), 0) & shared_bit:
                gone = active & ~(gpu | host)
                if gone:
                    ended.append((depth, gone))
                    active &= ~gone
                    if not active:
                        break
            rest = active & ~gpu
            if not rest:
                continue
            if not host and rest == active:  # all of them: the shared tier's
                bulk.append(depth)
                continue
            while rest:
                low = rest & -rest
                rest ^= low
                counts = extra.setdefault(low, [0, 0])
                counts[0 if host & low else 1] += 1
        else:
            depth = len(block_hashes)
        if active:
            ended.append((depth, active))
        extra_mask = 0
        for low in extra:
            extra_mask |= low
        groups: dict[tuple[int, int, int], int] = defaultdict(int)
        for end, ended_here in ended:
            shared = bisect_left(bulk, end)
            plain = ended_here & ~extra_mask
            if plain:
                groups[(end - shared, 0, shared)] |= plain
            own = ended_here & extra_mask
            while own:
                low = own & -own
                own ^= low
                host, own_shared = extra[low]
                groups[(end - shared - host - own_shared, host, shared + own_shared)] |= low
        return list(groups.items())

    def holders(self, block_hash: int) -> set[tuple[str, str]]:
        masks = self._masks
        return {(holder, t) for t in TIERS
                for holder in self.holder_names(masks.get((block_hash, t), 0))}  # fmt: skip

    def num_blocks(self, holder: str, tier: str = GPU) -> int:
        return len(self._blocks.get((holder, tier), ()))

    def sizes(self) -> dict[tuple[str, str], int]:
        """(holder, tier) -> how many blocks the index knows there."""
        return {key: len(blocks) for key, blocks in self._blocks.items()}
