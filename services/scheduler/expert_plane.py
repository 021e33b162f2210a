"""The scheduler's expert balancer, put together: its state, the rollout of
placements, the gRPC service and the NATS subscription to the expert
services' load reports. The scheduler's process adds it to its server and
ticks it from its loop."""

from __future__ import annotations

import logging

from proto.yinian.v1 import expert_pb2, expert_pb2_grpc
from services.common.bus import EventBus, expert_load_subject
from services.common.channels import WorkerChannels
from services.expert_parallel import metrics
from services.scheduler.expert_balancer import ExpertBalancer
from services.scheduler.expert_rollout import ExpertRollout
from services.scheduler.expert_servicer import ExpertBalancerServicer

logger = logging.getLogger(__name__)


class ExpertPlane:
    def __init__(self, config, tls=None):
        self.balancer = ExpertBalancer(
            config.expert_redundant_slots, config.heartbeat_timeout, config.eplb_groups
        )
        self.channels = WorkerChannels(tls)
        self.rollout = ExpertRollout(self.balancer, self.channels, config.eplb_interval,
                                     config.eplb_window)  # fmt: skip
        self.servicer = ExpertBalancerServicer(self.balancer, self.rollout,
                                               config.heartbeat_timeout / 4)  # fmt: skip
        self._measured_layers = 0

    def add_to(self, server) -> None:
        server.add(expert_pb2_grpc.add_ExpertBalancerServicer_to_server, self.servicer,
                   ["yinian.v1.ExpertBalancer"])  # fmt: skip

    async def subscribe(self, bus: EventBus) -> None:
        def on_load(report: expert_pb2.ExpertLoad, headers) -> None:
            self.balancer.on_load(report)

        await bus.subscribe(expert_load_subject(), expert_pb2.ExpertLoad, on_load,
                            lambda m: expert_load_subject(m.expert_id))  # fmt: skip

    async def tick(self, bus_connected: bool = True) -> None:
        if not bus_connected:
            self.balancer.touch_all()
        try:
            await self.rollout.tick()
        except Exception:  # the balancer must never stop the scheduler
            logger.exception("expert balancer tick failed")
        measured, _ = self.balancer.measured_imbalance()
        for layer, value in enumerate(measured):
            metrics.LAYER_IMBALANCE.labels(layer=str(layer)).set(value)

    async def close(self) -> None:
        await self.channels.close()
