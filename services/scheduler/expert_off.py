"""The scheduler without its expert balancer (`--no-expert-balancer`): every
balancer RPC is refused with FAILED_PRECONDITION, saying why, and nothing of
the balancer (nor torch, which it computes with) is loaded."""

from __future__ import annotations

import grpc

from proto.yinian.v1 import expert_pb2, expert_pb2_grpc

MESSAGE = "this scheduler runs without the expert balancer (--no-expert-balancer)"


class BalancerOff(expert_pb2_grpc.ExpertBalancerServicer):
    pass


async def _refuse(self, request, context):
    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, MESSAGE)


for _method in expert_pb2.DESCRIPTOR.services_by_name["ExpertBalancer"].methods:
    setattr(BalancerOff, _method.name, _refuse)


class NoExpertPlane:
    """ExpertPlane's place in the scheduler's process, with nothing to balance."""

    def add_to(self, server) -> None:
        server.add(expert_pb2_grpc.add_ExpertBalancerServicer_to_server, BalancerOff(),
                   ["yinian.v1.ExpertBalancer"])  # fmt: skip

    async def subscribe(self, bus) -> None:
        return None

    async def tick(self, bus_connected: bool = True) -> None:
        return None

    async def close(self) -> None:
        return None
