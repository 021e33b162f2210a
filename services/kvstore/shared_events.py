"""The shared tier's changes as numbered batches for SharedKvEvents: blocks
that entered (stored) or left (evicted, dropped) Redis since the last batch.
After start, after Redis came back, and when a subscriber asks, the next
batch is a reset snapshot of everything in Redis, so a subscriber's index
(the scheduler's) can rebuild from it. Large batches are split so no NATS
message outgrows the server's payload limit; the numbering stays gapless."""

from __future__ import annotations

from dataclasses import dataclass

MAX_HASHES_PER_BATCH = 50_000  # ~9 bytes each on the wire, well under NATS's 1 MiB


@dataclass(slots=True)
class SharedBatch:
    event_id: int
    stored: list[int]
    removed: list[int]
    reset: bool


class SharedEventLog:
    def __init__(self, max_hashes: int = MAX_HASHES_PER_BATCH):
        self.max_hashes = max_hashes
        self.next_id = 1
        self._stored: dict[int, None] = {}  # insertion-ordered sets
        self._removed: dict[int, None] = {}
        self._reset = False
        self.reset_wanted = True  # the first batch is a snapshot
        # Changes made while a snapshot is read from Redis, replayed onto it
        # (set operations, so one the scan already saw is harmless).
        self._journal: list[tuple[bool, list[int]]] | None = None

    def begin_snapshot(self) -> None:
        self._journal = []

    def snapshot(self, hashes) -> None:
        """Everything in Redis now: the next batch is a reset listing it."""
        journal, self._journal = self._journal or [], None
        self._stored = dict.fromkeys(hashes)
        self._removed = {}
        self._reset = True
        self.reset_wanted = False
        self._replay(journal)

    def abort_snapshot(self) -> None:
        journal, self._journal = self._journal or [], None
        self._replay(journal)

    def _replay(self, journal) -> None:
        for entered, hashes in journal:
            (self.stored if entered else self.removed)(hashes)

    def _journaled(self, entered: bool, hashes) -> bool:
        """Whether a snapshot is being read, so the change waits in the journal."""
        if self._journal is None:
            return False
        self._journal.append((entered, list(hashes)))
        return True

    def stored(self, hashes) -> None:
        if self._journaled(True, hashes):
            return
        for h in hashes:
            self._removed.pop(h, None)
            self._stored[h] = None

    def removed(self, hashes) -> None:
        if self._journaled(False, hashes):
            return
        for h in hashes:
            self._stored.pop(h, None)
            if not self._reset:  # a snapshot does not list what left
                self._removed[h] = None

    def batches(self) -> list[SharedBatch]:
        """The numbered batches of what changed since the last call (none if nothing)."""
        if not (self._stored or self._removed or self._reset):
            return []
        stored, removed = list(self._stored), list(self._removed)
        out = []
        first = True
        while first or stored or removed:
            take = stored[: self.max_hashes]
            stored = stored[len(take) :]
            room = self.max_hashes - len(take)
            gone, removed = removed[:room], removed[room:]
            out.append(SharedBatch(self.next_id, take, gone, self._reset and first))
            self.next_id += 1
            first = False
        self._stored, self._removed, self._reset = {}, {}, False
        return out
