"""Drafts from the worker's recent requests: a bounded table from each context
of `shortest`..`longest` tokens seen in a finished request (prompt and output)
to how often each token followed it. Drafting from a sequence's tail takes the
most frequent next token after its longest known context, appends it and
repeats, up to k tokens or until no context is known. The table keeps the most
recently used contexts up to `capacity` (least recently used dropped first);
only a request's last `window` tokens are added. Contexts are kept per prefix-cache
namespace (tenant): one tenant's text never drafts another's, whose acceptance
(and so its speed) would otherwise tell what the first one wrote.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class DraftTrie:
    def __init__(self, shortest: int, longest: int, capacity: int = 1 << 18, window: int = 4096):
        if not 1 <= shortest <= longest:
            raise ValueError("draft contexts need 1 <= shortest <= longest")
        self.shortest, self.longest = shortest, longest
        self.capacity, self.window = capacity, window
        self._next: OrderedDict[tuple, dict[int, int]] = OrderedDict()  # (namespace, *tokens)

    def __len__(self) -> int:
        return len(self._next)

    def add(self, tokens: np.ndarray, namespace: str = "") -> None:
        """Counts every (context, next token) pair of the sequence's last `window` tokens."""
        seq = tokens[-self.window :].tolist()
        table = self._next
        for end in range(1, len(seq)):
            nxt = seq[end]
            for n in range(self.shortest, min(self.longest, end) + 1):
                ctx = (namespace, *seq[end - n : end])
                counts = table.get(ctx)
                if counts is None:
                    counts = table[ctx] = {}
                else:
                    table.move_to_end(ctx)
                counts[nxt] = counts.get(nxt, 0) + 1
        while len(table) > self.capacity:
            table.popitem(last=False)

    def drafts(self, tokens: np.ndarray, k: int, namespace: str = "") -> list[int]:
        """Up to k tokens predicted after `tokens` (the most frequent continuation)."""
        tail = tokens[-self.longest :].tolist()
        out: list[int] = []
        while len(out) < k:
            counts = None
            for n in range(min(self.longest, len(tail)), self.shortest - 1, -1):
                counts = self._next.get((namespace, *tail[len(tail) - n :]))
                if counts:
                    break
            if not counts:
                break
            token = max(counts, key=counts.__getitem__)
            out.append(token)
            tail = (tail + [token])[-self.longest :]
        return out
