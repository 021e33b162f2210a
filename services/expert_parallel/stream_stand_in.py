"""What keeps a worker's step going when an expert service of its stream group
dies: the worker answers in its place.

On a GPU the worker's stream waits for each member's REPLIED flag with no host
in the loop (services/expert_parallel/stream_port.py), so a member that dies
mid-step would stall it for good. A watchdog thread of the worker checks each
member's process every WATCH seconds (and its GONE flag); for a member found
dead it starts a stand-in: a thread of the worker that serves that member's
slots as the member would, computing the member's part from the worker's own
copy of the experts (a worker holds every expert, for this) on a stream of its
own, and writing REPLIED from it. The waits in flight then end with the right
sum, and `lost(member)` tells the worker to route the next dispatches
elsewhere (its control loop forms a new group at a step boundary). On the CPU
the engine thread's own wait sees the death first and starts the stand-in the
same way.

A slot the dead member took (TAKEN set) but never answered is served again; one
it answered is not (REPLIED set); `served` keeps the stand-in from serving one
dispatch twice while the worker has not consumed it yet (TAKEN reset).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)
WATCH = 0.05  # seconds between the watchdog's looks
IDLE = 5e-5  # seconds a stand-in sleeps when no slot of its member has work


class StandIn(threading.Thread):
    """Serves `member`'s slots of `port` with `compute(layer, tokens, weights, ids)`
    until the port closes."""

    def __init__(self, port, member: int, compute: Callable):
        super().__init__(daemon=True, name=f"expert-stand-in-{member}")
        self.port, self.member, self.compute = port, member, compute
        self.stream = torch.cuda.Stream(port.device) if port.device.type == "cuda" else None
        self.served = [False] * port.slots
        self.answered = 0

    def run(self) -> None:
        try:
            while not self.port.closed:
                if not any([self._look(slot) for slot in range(self.port.slots)]):
                    time.sleep(IDLE)
        except Exception:  # noqa: BLE001 - the worker's timeout or the next group takes over
            logger.exception("the stand-in for expert service %d failed", self.member + 1)

    def _look(self, slot: int) -> bool:
        port, host = self.port, self.port.flags.host
        sent, replied, taken = port.index(self.member, slot)
        if self.served[slot]:
            if host[taken] == 0:  # the worker consumed the answer
                self.served[slot] = False
            return False
        value = host[sent] or host[taken]
        if host[replied] or not value:  # answered by the member before it died, or idle
            return False
        host[taken], host[sent] = value, 0
        self.served[slot] = True
        layer, rows = (value >> 32) - 1, value & 0xFFFFFFFF
        ids = port.ids[self.member, slot, :rows]
        with torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext():
            with torch.inference_mode():
                part = self.compute(layer, port.tokens[slot, :rows], port.weights[slot, :rows], ids)
            port.out[self.member, slot, :rows].copy_(part, non_blocking=True)
            port.flags.write(replied, 1)  # from this stream: once the part is in place
        self.answered += 1
        return True


class Watchdog(threading.Thread):
    """Looks at each member of `port` every WATCH seconds; `port.lose(member)` for
    one that is gone."""

    def __init__(self, port):
        super().__init__(daemon=True, name="expert-stream-watchdog")
        self.port = port

    def run(self) -> None:
        while not self.port.closed:
            for member in range(self.port.members):
                if member not in self.port.stand_ins and self.port.dead(member):
                    self.port.lose(member)
            time.sleep(WATCH)
