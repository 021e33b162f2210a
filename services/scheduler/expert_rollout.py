"""Applying placements while serving, in three phases:

1. every member of the new placement loads the experts it will hold (beside
   the ones it holds now: no worker still routing by the old placement is
   refused);
2. the placement becomes the one `GetPlacement` answers; each worker switches
   its routing at a step boundary and says so in its next poll;
3. once every live worker has switched, the members free what they no longer
   need.

Also here: the first placement (once registrations settle), periodic EPLB
with its statistics window (services count load only inside it), and repair
when a member is lost (a new EPLB over the survivors; without room for every
expert, the old placement minus the lost member, the workers computing the
orphans themselves).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from proto.yinian.v1 import expert_pb2, expert_pb2_grpc
from services.common.channels import WorkerChannels
from services.expert_parallel import metrics
from services.expert_parallel.placement import Placement, expert_set
from services.scheduler.expert_balancer import ExpertBalancer

logger = logging.getLogger(__name__)
SETTLE_SECONDS = 1.0  # quiet time after the last registration before a first placement
LOAD_TIMEOUT = 120.0


class ExpertRollout:
    def __init__(self, balancer: ExpertBalancer, channels: WorkerChannels,
                 interval: float = 0.0, window: float = 10.0, clock=time.monotonic):  # fmt: skip
        self.balancer, self.channels = balancer, channels
        self.interval, self.window, self.clock = interval, window, clock
        self.next_rebalance = clock() + interval if interval > 0 else None
        self._lock = asyncio.Lock()
        self._unfreed: Placement | None = None  # applied; old experts not freed yet
        self._collecting: dict[str, bool] = {}

    def _stub(self, address: str) -> expert_pb2_grpc.ExpertStub:
        return self.channels.stub(address, expert_pb2_grpc.ExpertStub)

    # -- what the scheduler's loop calls ---------------------------------------
    async def tick(self) -> None:
        balancer = self.balancer
        for expert_id in balancer.expire():
            logger.warning("expert service %s stopped reporting", expert_id)
        if balancer.lost_members():
            await self.repair(set(balancer.lost_members()))
        elif balancer.services and (balancer.placement is None or not balancer.placement.members):
            if self.clock() - balancer.changed_at >= SETTLE_SECONDS:
                await self.rebalance("initial")
        elif self.next_rebalance is not None and self.clock() >= self.next_rebalance:
            self.next_rebalance = self.clock() + self.interval
            await self.rebalance("periodic")
        await self._set_collection()
        await self._free_if_switched()

    async def rebalance(self, cause: str) -> tuple[Placement | None, list[float], list[float]]:
        """EPLB now; returns (placement served after it, imbalance before, after)."""
        async with self._lock:
            balancer = self.balancer
            window_tokens = float(balancer.window.sum()) if balancer.window is not None else 0.0
            before = balancer.predicted_imbalance(balancer.placement)
            planned = balancer.plan()
            if planned is None:
                return balancer.placement, before, []
            after = balancer.predicted_imbalance(planned)
            if await self._apply(planned, cause):
                logger.info("placement %d (%s) on %d services, %.0f tokens gathered; max/mean "
                            "%s -> %s", planned.version, cause, len(planned.members),
                            window_tokens, _fmt(before), _fmt(after))  # fmt: skip
            return balancer.placement, before, after

    async def repair(self, lost: set[str]) -> None:
        """Members gone: place their experts on the others."""
        async with self._lock:
            for expert_id in lost:
                self.balancer.deregister(expert_id)
            planned = self.balancer.plan()
            if planned is not None and await self._apply(planned, "repair"):
                logger.warning("placement %d: %s lost, their experts placed on %d services",
                               planned.version, sorted(lost), len(planned.members))  # fmt: skip
                return
            degraded = self.balancer.degraded(lost)
            if degraded is not None:
                self.balancer.adopt(degraded)
                metrics.REBALANCES.labels(cause="degraded").inc()
                logger.warning("placement %d: %s lost, their experts computed by the workers",
                               degraded.version, sorted(lost))  # fmt: skip

    async def verify_lost(self, expert_ids: list[str]) -> None:
        """A worker could not reach these: drop those that do not answer us either."""
        lost = set()
        for expert_id in expert_ids:
            service = self.balancer.services.get(expert_id)
            if service is None:
                lost.add(expert_id)
                continue
            try:
                await self._stub(service.address).SetLoadCollection(
                    expert_pb2.LoadCollection(on=self._collecting.get(expert_id, False)),
                    timeout=1.0,
                )
            except grpc.RpcError:
                lost.add(expert_id)
        in_placement = {m.expert_id for m in self.balancer.placement.members} if (
            self.balancer.placement is not None) else set()  # fmt: skip
        if lost & in_placement:
            await self.repair(lost)

    # -- the phases ------------------------------------------------------------
    async def _apply(self, placement: Placement, cause: str) -> bool:
        calls = [
            self._stub(m.address).LoadExperts(
                expert_set(placement.version, placement.experts_of(i)), timeout=LOAD_TIMEOUT
            )
            for i, m in enumerate(placement.members)
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [m.expert_id for m, r in zip(placement.members, results)
                  if isinstance(r, BaseException)]  # fmt: skip
        if failed:
            logger.warning("placement %d not applied: %s could not load their experts",
                           placement.version, failed)  # fmt: skip
            return False
        self.balancer.adopt(placement)
        self._unfreed = placement
        metrics.REBALANCES.labels(cause=cause).inc()
        return True

    async def _free_if_switched(self) -> None:
        placement = self._unfreed
        if placement is None:
            return
        _, all_switched = self.balancer.workers_on(placement.version)
        if not all_switched:
            return
        async with self._lock:
            if self._unfreed is not placement:  # a newer one came meanwhile
                return
            self._unfreed = None
            calls = [
                self._stub(m.address).FreeExperts(
                    expert_set(placement.version, placement.experts_of(i)), timeout=10.0
                )
                for i, m in enumerate(placement.members)
            ]
            await asyncio.gather(*calls, return_exceptions=True)

    async def _set_collection(self) -> None:
        on = collecting(self.next_rebalance, self.clock(), self.window)
        for expert_id, service in list(self.balancer.services.items()):
            if self._collecting.get(expert_id) == on:
                continue
            try:
                await self._stub(service.address).SetLoadCollection(
                    expert_pb2.LoadCollection(on=on), timeout=1.0
                )
                self._collecting[expert_id] = on
            except grpc.RpcError:
                pass  # retried next tick; a dead one is expired by its silence
        for expert_id in list(self._collecting):
            if expert_id not in self.balancer.services:
                del self._collecting[expert_id]


def collecting(next_rebalance: float | None, now: float, window: float) -> bool:
    """Services count load only inside statistics windows: always when rebalancing
    happens on request only, else in the last `window` seconds before each one."""
    return next_rebalance is None or next_rebalance - now <= window


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.2f}" for v in values) + "]" if values else "-"
