"""The prefill service's gRPC servicer: decode the handoff request, run the
prefill core, encode its result (services/worker/wire.py; the span is in tracing.py)."""

from __future__ import annotations

from proto.yinian.v1 import worker_pb2, worker_pb2_grpc
from services.common.grpc_streams import answer_at_once
from services.prefill.prefill_core import PrefillCore
from services.prefill.tracing import handoff_span
from services.worker.wire import prefill_from_proto, result_to_chunk


class PrefillServicer(worker_pb2_grpc.PrefillServicer):
    def __init__(self, core: PrefillCore):
        self.core = core

    async def Prefill(self, request, context):
        await answer_at_once(context)
        engine_request, order = prefill_from_proto(request)
        with handoff_span(request, context) as span:
            result = await self.core.prefill(engine_request, order)
            span.record(result)
        yield result_to_chunk(result, self.core.num_layers)

    async def ReleaseKv(self, request, context):
        released = await self.core.release(request.lease_id)
        return worker_pb2.ReleaseKvResponse(released=released)
