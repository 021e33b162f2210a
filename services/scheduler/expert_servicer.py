"""The expert balancer's gRPC servicer: decode, call the balancer or the
rollout, encode."""

from __future__ import annotations

import asyncio

from proto.yinian.v1 import expert_pb2, expert_pb2_grpc
from services.common import mesh_token
from services.expert_parallel.placement import Placement
from services.scheduler.expert_balancer import ExpertBalancer
from services.scheduler.expert_rollout import ExpertRollout


class ExpertBalancerServicer(expert_pb2_grpc.ExpertBalancerServicer):
    def __init__(self, balancer: ExpertBalancer, rollout: ExpertRollout, report_interval: float):
        self.balancer, self.rollout = balancer, rollout
        self.report_interval = report_interval
        self._tasks: set[asyncio.Task] = set()

    def _current(self) -> expert_pb2.ExpertPlacement:
        placement = self.balancer.placement
        if placement is None:
            shape = self.balancer.shape
            if shape is None:
                return expert_pb2.ExpertPlacement(version=0)
            placement = Placement.empty(shape.num_layers, shape.num_experts, shape.model)
        return placement.to_message()

    def _background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def RegisterExpert(self, request, context):
        await mesh_token.only_itself(context, request.expert_id, "expert service")
        self.balancer.register(request)  # ValueError -> INVALID_ARGUMENT
        return expert_pb2.RegisterExpertResponse(report_interval_seconds=self.report_interval)

    async def DeregisterExpert(self, request, context):
        await mesh_token.only_itself(context, request.expert_id, "expert service")
        if self.balancer.deregister(request.expert_id) and self.balancer.lost_members():
            self._background(self.rollout.repair(set(self.balancer.lost_members())))
        return expert_pb2.DeregisterExpertResponse()

    async def GetPlacement(self, request, context):
        if request.worker_id:
            self.balancer.worker_seen(request.worker_id, request.applied_version)
        return self._current()

    async def ReportLost(self, request, context):
        if request.expert_ids:
            await self.rollout.verify_lost(list(request.expert_ids))
        return self._current()

    async def Rebalance(self, request, context):
        window = self.balancer.window
        tokens = int(window.sum()) if window is not None else 0
        placement, before, after = await self.rollout.rebalance("manual")
        return expert_pb2.RebalanceResponse(
            version=placement.version if placement is not None else 0,
            imbalance_before=before,
            imbalance_after=after,
            window_tokens=tokens,
        )

    async def GetExpertStatus(self, request, context):
        measured, per_member = self.balancer.measured_imbalance()
        placement = self.balancer.placement
        workers, _ = self.balancer.workers_on(placement.version if placement else 0)
        return expert_pb2.ExpertStatus(
            placement=self._current(),
            measured_imbalance=measured,
            service_tokens=per_member,
            workers=workers,
            rebalances=self.balancer.rebalances,
            window_load=[] if self.balancer.window is None else
            self.balancer.window.flatten().tolist(),
        )  # fmt: skip
