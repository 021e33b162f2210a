"""A simulated worker's device KV pool, counted in the trace's blocks: blocks
held by running requests, cached blocks nobody holds (evicted oldest first,
as the engine's prefix cache does), and free ones. What becomes cached or is
evicted is kept as the KV events the worker would publish, for the
scheduler's KV index.

A request holds, from admission to its end, every block its prompt and output
will fill (no preemption: a request waits until its whole need fits). Its
prompt's leading blocks that are cached are shared; the blocks it computes
become cached under their hash ids once its prompt is done."""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"a block pool needs at least one block, got {capacity}")
        self.capacity = capacity
        self.free = capacity  # neither held nor cached
        self.refs: dict[int, int] = {}  # cached block -> requests holding it
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached, held by none: oldest first
        self.stored: list[int] = []  # events since `take_events`
        self.removed: list[int] = []

    def cached_prefix(self, hashes) -> int:
        """How many of the leading blocks are cached."""
        n = 0
        for h in hashes:
            if h not in self.refs:
                break
            n += 1
        return n

    def available(self) -> int:
        """Blocks a new request could take: free ones and idle cached ones."""
        return self.free + len(self.idle)

    def used(self) -> float:
        """The share of the pool held by requests (the worker's reported KV usage)."""
        return 1.0 - self.available() / self.capacity

    def admit(self, hashes, matched: int, blocks: int) -> bool:
        """Takes `blocks` for a request whose first `matched` prompt blocks are
        cached (shared: only the rest is new); False, changing nothing, when they
        do not fit."""
        hit = hashes[:matched]
        idle_hit = sum(1 for h in hit if self.refs[h] == 0)
        new = blocks - matched
        if self.available() - idle_hit < new:
            return False
        for h in hit:
            self._hold(h)
        for _ in range(new):
            self._take_one()
        return True

    def prompt_done(self, hashes, matched: int) -> None:
        """The request's computed prompt blocks become cached (one it computed that
        another request cached meanwhile is shared, its own copy freed)."""
        for h in hashes[matched:]:
            if h in self.refs:
                self._hold(h)
                self.free += 1
            else:
                self.refs[h] = 1
                self.stored.append(h)

    def release(self, hashes, held_hashes: int, blocks: int) -> None:
        """A request ends: its first `held_hashes` prompt blocks (cached, shared) are
        let go; the rest of its `blocks` are freed."""
        for h in hashes[:held_hashes]:
            refs = self.refs[h] - 1
            self.refs[h] = refs
            if refs == 0:
                self.idle[h] = None
        self.free += blocks - held_hashes

    def take_events(self) -> tuple[list[int], list[int]]:
        stored, removed = self.stored, self.removed
        self.stored, self.removed = [], []
        return stored, removed

    def _hold(self, h: int) -> None:
        refs = self.refs[h]
        if refs == 0:
            del self.idle[h]
        self.refs[h] = refs + 1

    def _take_one(self) -> None:
        if self.free:
            self.free -= 1
            return
        h, _ = self.idle.popitem(last=False)  # the oldest idle cached block
        del self.refs[h]
        self.removed.append(h)
