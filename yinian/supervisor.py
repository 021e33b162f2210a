"""Keeps a started mesh running (what `yinian up` does after "ready").

A child that exits — a crash, a kill -9, or a SIGTERM an operator sent it for a
rolling restart (a worker drains first) — is started again as it was (same
ports, same flags; a worker registers again) after a back-off that doubles
with each recent exit. One that keeps exiting, more than `max_restarts` times
within `window` seconds, ends supervision with `GaveUp`, whose message says
which child, how it ended and where its log is.

Restarted children die with the thread that started them (see children.py):
call `run` from a thread that lives as long as the mesh.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from yinian.mesh import Mesh


class GaveUp(Exception):
    """A child kept exiting; the mesh cannot be kept running."""


@dataclass
class _Watch:
    exits: deque = field(default_factory=deque)  # monotonic times of recent exits
    restart_at: float | None = None  # a restart waiting out its back-off
    starting_since: float | None = None  # relaunched, not ready yet
    restarts: int = 0
    back_at: float | None = None  # when the latest restart was seen ready


class Supervisor:
    def __init__(
        self,
        mesh: Mesh,
        max_restarts: int = 5,
        window: float = 60.0,
        backoff: float = 0.5,
        max_backoff: float = 10.0,
        start_timeout: float = 300.0,
        say: Callable[[str], None] = lambda line: print(line, flush=True),
    ):
        self.mesh = mesh
        self.max_restarts = max_restarts
        self.window = window
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.start_timeout = start_timeout
        self.say = say
        self._watches: dict[str, _Watch] = {}

    def restarts(self, name: str) -> int:
        return self._watches[name].restarts if name in self._watches else 0

    def back_at(self, name: str) -> float | None:
        """The monotonic time `name` was last seen ready after a restart."""
        return self._watches[name].back_at if name in self._watches else None

    def run(self, stop: threading.Event, interval: float = 0.2) -> None:
        """Watches until `stop` is set; raises GaveUp."""
        while not stop.wait(interval):
            self.step()

    def step(self) -> None:
        """One look at every child: restarts what is due, notes what exited."""
        now = time.monotonic()
        for child in list(self.mesh.children):
            name = child.name
            watch = self._watches.setdefault(name, _Watch())
            if watch.restart_at is not None:
                if now >= watch.restart_at:
                    watch.restart_at, watch.starting_since = None, now
                    watch.restarts += 1
                    self.mesh.relaunch(name)
                continue
            code = child.proc.poll()
            if watch.starting_since is not None:
                if child.ready.is_set():
                    watch.starting_since, watch.back_at = None, now
                    self.say(f"{name} is back (restart {watch.restarts})")
                elif code is None and now - watch.starting_since > self.start_timeout:
                    self.say(f"{name} not ready {self.start_timeout:.0f} s after its restart")
                    self.mesh.kill(name)
                    code = child.proc.returncode
            if code is not None:
                self._exited(child, watch, now)

    def _exited(self, child, watch: _Watch, now: float) -> None:
        watch.starting_since = None
        watch.exits.append(now)
        while watch.exits and now - watch.exits[0] > self.window:
            watch.exits.popleft()
        if len(watch.exits) > self.max_restarts:
            raise GaveUp(
                f"{child.failure()}; it exited {len(watch.exits)} times within "
                f"{self.window:.0f} s, so the mesh is stopping"
            )
        delay = min(self.max_backoff, self.backoff * 2 ** (len(watch.exits) - 1))
        self.say(f"{child.name} {child.exit_status()}; restarting it in {delay:.1f} s")
        watch.restart_at = now + delay
