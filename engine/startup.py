"""How long an engine took to start, phase by phase (the model's config and
tokenizer, the other ranks, the weights, the KV cache, the kernels' warm-up, the
decode graphs, the host tier), so a slow start says where its time went."""

from __future__ import annotations

import time


class StartupPhases:
    """Seconds by phase, each from the end of the one before (`mark` ends one)."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.seconds: dict[str, float] = {}
        self._since = clock()

    def mark(self, phase: str) -> None:
        """Ends `phase` now (its time: since the last mark, or since the start)."""
        now = self.clock()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._since
        self._since = now

    def take(self, other: StartupPhases) -> None:
        """Adds `other`'s phases (a part built within this one's time) and goes on
        from its end."""
        for phase, seconds in other.seconds.items():
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
        self._since = other._since

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def __str__(self) -> str:
        parts = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self.seconds.items())
        return f"{self.total:.1f} s ({parts})"
