"""The KV store's memory tier: whole blocks in the store's own memory, in front
of Redis. Same-host PutFrom and GetInto copy between a worker's host tier and
this memory with threads at memory speed (no Python bytes, no Redis); remote
Put and Get read and write it too.

The memory is one region cut into slots of one block size (the first block
stored, or the first worker to ask for a lend, fixes it; blocks of another
size go to Redis): a file in shared memory where there is room
(memory_region.py), so that `lend` can tell a worker on this host where a
block lies and the worker copies it to its GPU itself. Each block keeps its
owner namespace (tenant or public), fingerprint, parent hash and XXH3-64
checksum; a copy out is verified against the checksum before the caller is
told it holds the block (a lent block is verified by its borrower). Eviction
is LRU with the shared tier's rules: a tenant over its quota evicts its own
blocks, a full tier the least recently used; leased, lent and in-copy blocks
are skipped. An evicted block is offered to `on_evict` (the store spills it
to Redis) before its slot is reused; a lent block's slot is never reused
before its lend ends.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from services.common import metrics
from services.common.kv_checksum import block_checksum
from services.kvstore.block_format import Block
from services.kvstore.fingerprint import Fingerprint
from services.kvstore.ledger import Ledger
from services.kvstore.memory_region import MemoryRegion
from services.kvstore.quotas import Quotas
from services.kvstore.shared_tier import PutOutcome, TierSettings, readable

Key = tuple[str, str, int]  # (owner namespace, fingerprint id, block hash)
LEND_SECONDS = 5.0  # a lent block stays put this long: the borrower copies it well inside


@dataclass(slots=True)
class Entry:
    slot: int
    fingerprint: Fingerprint
    parent: int
    checksum: int
    leased_until: float = 0.0
    first_lease: float = 0.0


@dataclass(slots=True)
class Evicted:
    owner: str
    fingerprint: Fingerprint
    block_hash: int
    parent: int
    checksum: int
    payload: bytes


class MemoryTier:
    def __init__(
        self,
        capacity_bytes: int,
        quotas: Quotas,
        ledger: Ledger,
        settings: TierSettings,
        copy_threads: int = 8,
        on_change: Callable[[list[int], list[int]], None] = lambda stored, removed: None,
        on_evict: Callable[[Evicted], bool] = lambda evicted: False,
        shared_memory: bool = True,
    ):
        self.capacity, self.quotas, self.ledger, self.settings = (
            capacity_bytes, quotas, ledger, settings,
        )  # fmt: skip
        self.on_change, self.on_evict = on_change, on_evict
        self.slot_bytes = 0  # fixed by the first block stored
        self.shared_memory = shared_memory  # in a file workers on this host may map
        self._region: MemoryRegion | None = None
        self._opening = asyncio.Lock()
        self._rows: np.ndarray | None = None
        self._free: list[int] = []
        self._cooling: list[tuple[float, int]] = []  # (lent until, slot) of dropped lent blocks
        self._entries: OrderedDict[Key, Entry] = OrderedDict()  # least recently used first
        self._pending: set[Key] = set()
        self._pins: Counter[int] = Counter()
        self._tenant_blocks: Counter[str] = Counter()
        self._hashes: Counter[int] = Counter()  # of any owner and fingerprint
        self._pool = ThreadPoolExecutor(copy_threads, thread_name_prefix="kv-copy")
        self._threads = copy_threads

    # -- what it holds ---------------------------------------------------------
    def takes(self, nbytes: int) -> bool:
        """Whether a block of `nbytes` fits this tier's slots."""
        if self.slot_bytes == 0:
            return 0 < nbytes <= self.capacity
        return nbytes == self.slot_bytes

    def present(self, tenant: str, fingerprint: Fingerprint, hashes) -> list[str | None]:
        owners = readable(self.settings, tenant)
        out: list[str | None] = []
        fid, entries = fingerprint.id, self._entries
        for h in hashes:
            out.append(next((o for o in owners if (o, fid, h) in entries), None))
        return out

    def lease(self, fingerprint: Fingerprint, hashes, owners) -> None:
        """Keeps the blocks from eviction for a lease (and marks them recently used)."""
        now, s, fid = time.monotonic(), self.settings, fingerprint.id
        for h, owner in zip(hashes, owners):
            key = (owner, fid, h)
            entry = self._entries.get(key) if owner is not None else None
            if entry is None:
                continue
            if entry.leased_until < now:
                entry.first_lease = now
            entry.leased_until = min(now + s.lease_seconds, entry.first_lease + s.max_lease_seconds)
            self._entries.move_to_end(key)

    def holds_hash(self, block_hash: int) -> bool:
        return self._hashes[block_hash] > 0

    def tenants(self) -> list[str]:
        return sorted(t for t, n in self._tenant_blocks.items() if n)

    def usage(self, tenant: str) -> tuple[int, int]:
        blocks = self._tenant_blocks[tenant]
        return blocks, blocks * self.slot_bytes

    def snapshot(self) -> list[int]:
        return [h for _, _, h in self._entries]

    # -- writes ----------------------------------------------------------------
    async def put(
        self,
        tenant: str,
        fingerprint: Fingerprint,
        blocks: list[tuple[int, int, memoryview | bytes]],
        checksums: list[int] | None = None,
    ) -> list[PutOutcome]:
        """Stores (hash, parent, bytes) blocks, all of this tier's size, copying them
        in threads; checksums, when given, are what the bytes must match (else the
        block is rejected), otherwise they are computed here."""
        outcomes: list[PutOutcome | None] = [None] * len(blocks)
        todo: list[tuple[int, Key, int]] = []  # (index, key, slot)
        for _, _, data in blocks:
            if not self.takes(len(data)):
                raise ValueError(f"a block of {len(data)} bytes in slots of {self.slot_bytes}")
        if blocks:
            await self.open(len(blocks[0][2]))
        for i, (block_hash, _, _) in enumerate(blocks):
            key = (tenant, fingerprint.id, block_hash)
            if key in self._entries or key in self._pending:
                if key in self._entries:
                    self._entries.move_to_end(key)
                outcomes[i] = PutOutcome("present")
                continue
            slot, refusal = self._make_room(tenant)
            if slot is None:
                outcomes[i] = refusal
                continue
            self._pending.add(key)
            self._pins[slot] += 1
            todo.append((i, key, slot))
        try:
            sums = await self._run([(self._store_one, slot, blocks[i][2]) for i, _, slot in todo])
        except BaseException:
            self._free += [slot for _, _, slot in todo]
            raise
        finally:
            for _, key, slot in todo:
                self._pending.discard(key)
                self._unpin(slot)
        stored = []
        for (i, key, slot), checksum in zip(todo, sums):
            if checksums is not None and checksums[i] != checksum:
                self._free.append(slot)
                outcomes[i] = PutOutcome("rejected", "checksum", "checksum mismatch")
                continue
            self._entries[key] = Entry(slot, fingerprint, blocks[i][1], checksum)
            self._tenant_blocks[tenant] += 1
            self._hashes[key[2]] += 1
            stored.append(key[2])
            outcomes[i] = PutOutcome("stored")
        if stored:
            metrics.KVSTORE_MEMORY_BLOCKS.set(len(self._entries))
            self.on_change(stored, [])
        return outcomes  # type: ignore[return-value]

    async def open(self, slot_bytes: int) -> None:
        """Makes the region with slots of `slot_bytes`, once (in a thread: reserving
        many GiB of shared memory takes seconds)."""
        async with self._opening:
            if self._region is not None:
                return
            slots = self.capacity // slot_bytes
            region = await asyncio.to_thread(MemoryRegion, slots, slot_bytes, self.shared_memory)
            self._region, self.slot_bytes, self._rows = region, slot_bytes, region.rows
            self._free = list(range(slots - 1, -1, -1))

    @property
    def region(self) -> tuple[str, int] | None:
        """(path, size) of the shared-memory file workers on this host map, if any."""
        return self._region.shared if self._region is not None else None

    def _store_one(self, slot: int, data) -> int:
        row = self._rows[slot]
        np.copyto(row, np.frombuffer(data, dtype=np.uint8))
        return block_checksum(row)

    def _make_room(self, tenant: str) -> tuple[int | None, PutOutcome | None]:
        quota = self.quotas.for_tenant(tenant)
        if self.slot_bytes > quota:
            return None, PutOutcome("rejected", "too_large", f"a block exceeds the quota {quota}")
        limited = quota < len(self._rows) * self.slot_bytes  # else the capacity rules
        while limited and (self._tenant_blocks[tenant] + 1) * self.slot_bytes > quota:
            if not self._evict_one(tenant, "quota"):
                return None, PutOutcome("rejected", "quota", f"tenant over its quota of {quota}")
        self._reclaim_cooled()
        if not self._free and not self._evict_one(None, "capacity"):
            return None, PutOutcome(
                "rejected", "capacity", "the memory tier is full of leased blocks"
            )
        return self._free.pop(), None

    def _evict_one(self, tenant: str | None, reason: str) -> bool:
        now = time.monotonic()
        for scanned, (key, entry) in enumerate(self._entries.items()):
            if scanned >= self.settings.scan_limit:
                return False
            if tenant is not None and key[0] != tenant:
                continue
            if entry.leased_until > now or self._pins[entry.slot]:
                continue
            del self._entries[key]
            self._forget(key)
            self.ledger.evicted(key[0], 1, reason)
            payload = self._rows[entry.slot].tobytes()
            kept = self.on_evict(
                Evicted(key[0], entry.fingerprint, key[2], entry.parent, entry.checksum, payload)
            )
            self._free.append(entry.slot)
            if not kept and not self.holds_hash(key[2]):
                self.on_change([], [key[2]])
            return True
        return False

    def _forget(self, key: Key) -> None:
        self._tenant_blocks[key[0]] -= 1
        self._hashes[key[2]] -= 1
        if not self._hashes[key[2]]:
            del self._hashes[key[2]]
        metrics.KVSTORE_MEMORY_BLOCKS.set(len(self._entries))

    def _unpin(self, slot: int) -> None:
        self._pins[slot] -= 1
        if not self._pins[slot]:
            del self._pins[slot]

    # -- reads -----------------------------------------------------------------
    def leading(self, tenant: str, fingerprint: Fingerprint, hashes) -> list[tuple[Key, Entry]]:
        """The entries of the leading blocks this tier holds."""
        out, fid = [], fingerprint.id
        for owner in self.present(tenant, fingerprint, hashes):
            if owner is None:
                break
            key = (owner, fid, hashes[len(out)])
            out.append((key, self._entries[key]))
        return out

    async def read_into(self, entries: list[tuple[Key, Entry]], targets) -> int:
        """Copies the entries' blocks into `targets` (writable buffers of the slot
        size) in threads, each verified; the count of leading blocks written whole
        and verified. A block that fails verification is dropped."""
        for _, entry in entries:
            self._pins[entry.slot] += 1
        try:
            sums = await self._run(
                [(self._load_one, e.slot, t) for (_, e), t in zip(entries, targets)]
            )
        finally:
            for _, entry in entries:
                self._unpin(entry.slot)
        for n, ((key, entry), checksum) in enumerate(zip(entries, sums)):
            if checksum != entry.checksum:
                self.ledger.verification_failed(key[0], "checksum")
                self._drop(key)
                return n
        return len(entries)

    async def lend(
        self, tenant: str, fingerprint: Fingerprint, hashes, slot_bytes: int
    ) -> list[tuple[int, Entry]]:
        """(offset in the shared region, entry) of the leading blocks held here, each
        kept in place (neither evicted nor overwritten) for LEND_SECONDS; none when
        the region is private or its slots are of another size."""
        if not self.takes(slot_bytes):
            return []
        await self.open(slot_bytes)
        if self.region is None:
            return []
        entries = self.leading(tenant, fingerprint, hashes)
        self.lease(fingerprint, hashes[: len(entries)], [key[0] for key, _ in entries])
        until = time.monotonic() + LEND_SECONDS
        for _, entry in entries:
            entry.leased_until = max(entry.leased_until, until)
        return [(entry.slot * self.slot_bytes, entry) for _, entry in entries]

    def block(self, owner: str, fingerprint: Fingerprint, block_hash: int) -> Block | None:
        """A copy of the block, verified; None when it is gone or fails verification
        (then it is dropped)."""
        key = (owner, fingerprint.id, block_hash)
        entry = self._entries.get(key)
        if entry is None:
            return None
        payload = self._rows[entry.slot].tobytes()
        if block_checksum(payload) != entry.checksum:
            self.ledger.verification_failed(owner, "checksum")
            self._drop(key)
            return None
        return Block(block_hash, entry.parent, entry.checksum, payload)

    def _load_one(self, slot: int, target) -> int:
        dst = np.frombuffer(target, dtype=np.uint8)
        np.copyto(dst, self._rows[slot])
        return block_checksum(dst)

    def _drop(self, key: Key) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._forget(key)
            if entry.leased_until > time.monotonic():  # a borrower may be reading it
                self._cooling.append((entry.leased_until, entry.slot))
            else:
                self._free.append(entry.slot)
            if not self.holds_hash(key[2]):
                self.on_change([], [key[2]])

    def _reclaim_cooled(self) -> None:
        if self._cooling:
            now = time.monotonic()
            self._free += [slot for until, slot in self._cooling if until <= now]
            self._cooling = [(until, slot) for until, slot in self._cooling if until > now]

    async def _run(self, calls) -> list:
        """Runs (fn, slot, buffer) calls in the copy threads, in chunks, in order."""
        if not calls:
            return []
        loop = asyncio.get_running_loop()
        per = -(-len(calls) // self._threads)
        chunks = [calls[i : i + per] for i in range(0, len(calls), per)]
        results = await asyncio.gather(
            *(loop.run_in_executor(self._pool, _run_chunk, c) for c in chunks)
        )
        return [r for chunk in results for r in chunk]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._rows = None
        if self._region is not None:
            self._region.close()


def _run_chunk(calls) -> list:
    return [fn(slot, buffer) for fn, slot, buffer in calls]
