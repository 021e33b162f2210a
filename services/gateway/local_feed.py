"""What the gateway's placer hears on NATS (services/common/placement_feed.py),
and what it remembers of it beyond the scheduler's feed: which workers said they
are draining (so that a list of workers read just before their report does not
bring them back), and when a worker it does not know reported (a list to read
now; at most once a worker every `ASK_INTERVAL`)."""

from __future__ import annotations

import asyncio
import logging
import time

from services.common.placement_feed import PlacementFeed

logger = logging.getLogger(__name__)


class GatewayFeed(PlacementFeed):
    ASK_INTERVAL = 1.0  # seconds between two early lists for the same unknown worker

    def __init__(self, *args, clock=time.monotonic):
        super().__init__(*args)
        self.clock = clock
        self.unknown = asyncio.Event()  # set: read the scheduler's list now
        self.draining: dict[str, float] = {}  # worker id -> when it said it drains
        self._asked: dict[str, float] = {}

    async def on_load(self, report, headers) -> bool:
        worker_id = report.worker_id
        if report.draining:
            if worker_id in self.registry.workers:
                logger.info("%s drains: no more requests are placed there", worker_id)
            self.draining[worker_id] = self.clock()
        else:
            self.draining.pop(worker_id, None)  # it serves (again: a restart)
        known = await super().on_load(report, headers)
        now = self.clock()
        if not known and now - self._asked.get(worker_id, -1e9) >= self.ASK_INTERVAL:
            self._asked[worker_id] = now  # it may have just registered
            self.unknown.set()
        return known

    def drains(self, worker_id: str, within: float) -> bool:
        """Whether `worker_id` said it drains in the last `within` seconds."""
        said = self.draining.get(worker_id)
        if said is not None and self.clock() - said > within:
            del self.draining[worker_id]
            return False
        return said is not None
