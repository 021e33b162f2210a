"""Which worker holds which prefix-cache block, from the workers' KV events.

Each worker numbers its event batches; a gap (a lost message) or a reset (a
restarted worker) clears what is known of that worker, so the index may
under-report a worker's cache but never claims a block it lacks for long.
"""

from __future__ import annotations

from collections import defaultdict


class KvIndex:
    def __init__(self):
        self._holders: dict[int, set[str]] = defaultdict(set)
        self._blocks: dict[str, set[int]] = defaultdict(set)
        self._last_event: dict[str, int] = {}
        self.gaps = 0

    def apply(self, worker_id: str, event_id: int, stored, removed, reset: bool) -> None:
        last = self._last_event.get(worker_id)
        if reset or last is None or event_id != last + 1:
            if last is not None and not reset:
                self.gaps += 1
            self.forget(worker_id)
        self._last_event[worker_id] = event_id
        blocks = self._blocks[worker_id]
        for h in stored:
            self._holders[h].add(worker_id)
            blocks.add(h)
        for h in removed:
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self._holders[h]
            blocks.discard(h)

    def forget(self, worker_id: str) -> None:
        for h in self._blocks.pop(worker_id, ()):
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self._holders[h]
        self._last_event.pop(worker_id, None)

    def matched_blocks(self, worker_id: str, block_hashes) -> int:
        """How many leading blocks of a prompt the worker holds."""
        held = self._blocks.get(worker_id)
        if not held:
            return 0
        count = 0
        for h in block_hashes:
            if h not in held:
                break
            count += 1
        return count

    def num_blocks(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))
