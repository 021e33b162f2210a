"""Placement in the gateway: the scheduler's policy (services/common/placement.py)
run here, over a registry and a KV index this gateway keeps itself, so that a
request waits on no hop before its worker's.

- Who is registered, and the scheduler's placement settings (its flags): the
  scheduler's ListWorkers, read every `interval` seconds.
- Load (each report is also a heartbeat) and what each worker and the shared
  tier cache: the same NATS events the scheduler hears (PlacementFeed).

Until the first list and the NATS connection are in, while NATS is away (no
heartbeat can arrive: every worker would look dead), and when no worker here is
ready (the list may be behind a worker that just registered), the scheduler
places the request, as it does for a gateway without NATS. Requests placed here
count on their worker until its next load report, as the scheduler counts its
own; two gateways do not see each other's until then."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from opentelemetry import trace

from proto.yinian.v1 import common_pb2
from services.common import metrics
from services.common.bus import KV_RESYNC_SUBJECT, EventBus
from services.common.errors import WorkerUnavailable
from services.common.kv_index import KvIndex
from services.common.placement import SERVING_ROLES, PlacementPolicy, place
from services.common.placement_outcomes import Outcomes, answer, policy_of
from services.common.registry import Registry, WorkerState
from services.gateway.local_feed import GatewayFeed

logger = logging.getLogger(__name__)
UNLISTED_GRACE = 10.0  # seconds a worker still reporting stays once the list leaves it out
RESYNC_COVERS = 2.0  # seconds a snapshot asked of everyone spares asking one worker


class LocalPlacement:
    """A placer with the scheduler client's `place` (SchedulerClient.place)."""

    def __init__(self, scheduler, bus: EventBus, interval: float = 1.0, warm_up: float = 10.0):
        self.scheduler, self.bus, self.interval = scheduler, bus, interval
        self.warm_until = time.monotonic() + warm_up
        self.index = KvIndex()
        self.registry = Registry(forget=self.index.forget)  # its KV entries leave with it
        self.policy: PlacementPolicy | None = None  # none until the first list
        self.feed = GatewayFeed(self.registry, self.index, bus, metrics.GATEWAY_KV_INDEX_GAPS)
        self.outcomes = Outcomes(metrics.GATEWAY_PLACEMENTS, metrics.GATEWAY_PLACED_PREFIX_BLOCKS)
        self._task: asyncio.Task | None = None
        self._listening = False
        self._failing = False  # the last try to listen or list failed
        self._unlisted: dict[str, float] = {}  # worker id -> when a list first left it out
        self._block_size: int | None = None  # the one the listed workers share, if they do
        self._connected = False  # NATS, at the loop's last look
        self._said_old = False  # that the scheduler sends no placement settings
        self._everyone_asked = -1e9  # when a snapshot was last asked of every holder

    @property
    def ready(self) -> bool:
        """Places here (else the scheduler does): it has the scheduler's settings and
        hears NATS."""
        return self.policy is not None and self._listening and self.bus.connected

    @property
    def warming(self) -> bool:
        """Not ready yet, nor has it a ready worker, in its first `warm_up` seconds:
        the gateway is not ready either (so that what it serves first is placed here,
        as the rest will be; after them the scheduler places until it is)."""
        if self.warm_until is None:
            return False
        if (self.ready and self.registry.ready()) or time.monotonic() > self.warm_until:
            self.warm_until = None
        return self.warm_until is not None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.listen()
                back = self.bus.connected and not self._connected
                await self.refresh(ask_new=not back)
                if back:
                    # in, or back: a snapshot from every worker and the shared tier (what
                    # they did meanwhile went by unheard, and those listed meanwhile were
                    # asked while it could not say so), once they are registered here
                    await self._resync("")
                self._connected = self.bus.connected
                if self._failing:
                    logger.info("the placer hears NATS and the scheduler again")
                    self._failing = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS or the scheduler away
                if not self._failing:  # once a spell
                    logger.warning(
                        "the placer cannot follow NATS and the scheduler (%s): it places "
                        "from what it has while NATS is in, else the scheduler places",
                        exc,
                    )
                self._failing = True
            # often until it knows a ready worker (the first ones register as it starts);
            # early when a worker it does not know reports (it may have just registered)
            wait = self.interval if self.registry.ready() else self.interval / 10
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.feed.unknown.wait(), wait)
            self.feed.unknown.clear()

    async def listen(self) -> None:
        """Connects to NATS and subscribes, once (the client reconnects by itself)."""
        if not self._listening:
            if self.bus.nc is None:
                await self.bus.connect()
            await self.feed.listen()
            await self.bus.nc.flush()  # the server has the subscriptions: it hears now
            self._listening = True

    async def refresh(self, ask_new: bool = True):
        """Reads the scheduler's list of workers and settings, and returns it (raises
        grpc.RpcError when the scheduler is away); asks the workers listed anew for a
        snapshot (`ask_new`; not when everyone was asked just now)."""
        listing = await self.scheduler.list_workers()
        new = self.apply(listing)
        if ask_new and time.monotonic() - self._everyone_asked > RESYNC_COVERS:
            for worker_id in new:
                # its KV events so far went by unheard: a snapshot of what it caches
                await self._resync(worker_id)
        return listing

    async def _resync(self, holder: str) -> None:
        """Asks `holder` ("": every worker and the shared tier) for a snapshot (lost
        while NATS is away; the loop asks everyone once it is back)."""
        if not holder:
            self._everyone_asked = time.monotonic()
        await self.bus.publish(
            KV_RESYNC_SUBJECT, common_pb2.KvResync(worker_id=holder, reason="a gateway listens")
        )

    def apply(self, listing) -> list[str]:
        """Takes in a ListWorkersResponse: the settings, who is registered (a worker
        listed anew, or with other info, is registered here), and who missed its
        heartbeats. A worker no longer listed leaves once its reports stop too, or
        after `UNLISTED_GRACE` seconds (a scheduler that just restarted lists nobody
        until the workers it hears from register again; a draining worker says so in
        its reports and leaves at once). Returns the workers registered anew."""
        registry = self.registry
        if not listing.HasField("placement"):  # a scheduler older than this gateway
            if not self._said_old:
                logger.warning("the scheduler says nothing of how it places: it places")
                self._said_old = True
            self.policy = None
            return []
        settings = listing.placement
        self.policy = policy_of(settings)
        registry.heartbeat_timeout = settings.heartbeat_timeout_seconds or 2.0
        now = registry.clock()
        listed, new = set(), []
        for status in listing.workers:
            info = status.info
            listed.add(info.worker_id)
            known = registry.workers.get(info.worker_id)
            if known is not None and known.info == info:
                continue
            if self.feed.drains(info.worker_id, 2 * registry.heartbeat_timeout):
                continue  # a list read before the scheduler heard it drains
            registry.register(WorkerState.from_info(info))
            new.append(info.worker_id)
            registry.on_load(info.worker_id, status.num_requests_running,
                             status.num_requests_waiting, status.kv_cache_usage)  # fmt: skip
            registry.workers[info.worker_id].last_seen = now - status.seconds_since_report
        unlisted = self._unlisted
        for worker_id in [w for w in unlisted if w in listed or w not in registry.workers]:
            del unlisted[worker_id]
        for worker_id, state in list(registry.workers.items()):
            if worker_id in listed:
                continue
            since = unlisted.setdefault(worker_id, now)
            if not registry.is_ready(state) or now - since > UNLISTED_GRACE:
                registry.deregister(worker_id)
                del unlisted[worker_id]
        registry.expire()
        sizes = {w.block_size for w in registry.workers.values()}
        self._block_size = sizes.pop() if len(sizes) == 1 else None
        return new

    def serving(self) -> int:
        """The ready workers here a request can be placed on (0 unless it places)."""
        if not self.ready:
            return 0
        return sum(w.role in SERVING_ROLES for w in self.registry.ready())

    def hash_block_size(self, default: int) -> int:
        """The blocks to hash a prompt in: the workers' own when they all share one
        (no gateway flag to keep in step with theirs), else `default`."""
        return self._block_size or default

    async def place(self, request_id, prompt_tokens, block_hashes, tenant, exclude,
                    block_size: int = 0):  # fmt: skip
        span = trace.get_current_span()
        if self.ready:
            try:
                decision = place(self.registry, self.index, self.policy, block_hashes,
                                 prompt_tokens, exclude=set(exclude))  # fmt: skip
            except WorkerUnavailable:  # none ready here: the list may be behind
                pass
            except Exception as exc:
                self.outcomes.failed(exc)
                raise
            else:
                self.outcomes.placed(decision, block_size)
                span.set_attribute("yinian.placed_by", "gateway")
                placement = answer(decision)
                self.scheduler.recent.add(placement)  # where to go were both away
                return placement
        span.set_attribute("yinian.placed_by", "scheduler")
        return await self.scheduler.place(
            request_id, prompt_tokens, block_hashes, tenant, exclude, block_size
        )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.bus.close()
