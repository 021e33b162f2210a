"""The expert service's gRPC servicer: decode, call the store or the group
server, encode."""

from __future__ import annotations

import asyncio

from proto.yinian.v1 import expert_pb2, expert_pb2_grpc
from services.expert.expert_store import ExpertStore
from services.expert.serving import GroupServer
from services.expert_parallel import metrics
from services.expert_parallel.placement import expert_lists


def load_message(store: ExpertStore, expert_id: str, counts=None) -> expert_pb2.ExpertLoad:
    return expert_pb2.ExpertLoad(
        expert_id=expert_id,
        num_layers=store.num_layers,
        num_experts=store.num_experts,
        counts=[] if counts is None else counts.flatten().tolist(),
        collecting=store.collecting,
        held_version=store.held_version,
    )


class ExpertServicer(expert_pb2_grpc.ExpertServicer):
    def __init__(self, store: ExpertStore, groups: GroupServer, expert_id: str):
        self.store, self.groups, self.expert_id = store, groups, expert_id

    async def Join(self, request, context):
        self.groups.join(request)  # ValueError -> INVALID_ARGUMENT
        return expert_pb2.JoinResponse()

    async def LoadExperts(self, request, context):
        wanted = expert_lists(request)
        loaded = await asyncio.to_thread(self.store.load, request.version, wanted)
        return self._held(loaded=loaded)

    async def FreeExperts(self, request, context):
        freed = await asyncio.to_thread(self.store.keep, expert_lists(request))
        return self._held(freed=freed)

    async def GetExpertLoad(self, request, context):
        return load_message(self.store, self.expert_id, self.store.take_counts())

    async def SetLoadCollection(self, request, context):
        self.store.collecting = request.on
        return expert_pb2.LoadCollection(on=self.store.collecting)

    def _held(self, loaded: int = 0, freed: int = 0) -> expert_pb2.ExpertSetResponse:
        held = sum(len(layer) for layer in self.store.held())
        metrics.SERVICE_HELD.labels(expert_id=self.expert_id).set(held)
        return expert_pb2.ExpertSetResponse(loaded=loaded, freed=freed, held=held)
