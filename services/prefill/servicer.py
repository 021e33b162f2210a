"""The prefill service's gRPC servicer: decode the handoff request, run the
prefill core, encode its result (the span is in tracing.py)."""

from __future__ import annotations

from proto.yinian.v1 import worker_pb2, worker_pb2_grpc
from services.common.convert import params_from_proto
from services.common.grpc_streams import answer_at_once
from services.prefill.prefill_core import PrefillCore
from services.prefill.tracing import handoff_span
from services.worker.handoff import result_to_chunk


class PrefillServicer(worker_pb2_grpc.PrefillServicer):
    def __init__(self, core: PrefillCore):
        self.core = core

    async def Prefill(self, request, context):
        await answer_at_once(context)
        params = params_from_proto(request.params)
        with handoff_span(request, context) as span:
            result = await self.core.prefill(
                request.request_id,
                list(request.prompt_token_ids),
                params,
                request.transport,
                request.transport_target,
                list(request.dst_block_ids),
                request.skip_blocks,
                tenant=request.tenant,
                public_tokens=request.public_tokens,
                priority=request.priority,
                lease_seconds=request.lease_seconds or 30.0,
            )
            span.record(result)
        yield result_to_chunk(result, self.core.num_layers)

    async def ReleaseKv(self, request, context):
        released = await self.core.release(request.lease_id)
        return worker_pb2.ReleaseKvResponse(released=released)
