"""The prefill RPCs of the Worker service (served by prefill-role workers):
decode the handoff request, run the prefill core, encode its result."""

from __future__ import annotations

from opentelemetry import trace

from proto.yinian.v1 import common_pb2, worker_pb2
from services.common.convert import params_from_proto
from services.common.spans import request_attributes
from services.common.telemetry import context_from_grpc, tracer
from services.prefill.prefill_core import PrefillCore

_tracer = tracer("yinian.prefill")


class PrefillMethods:
    """Mixed into the worker servicer; `self.prefill_core` is None off the prefill role."""

    prefill_core: PrefillCore | None = None

    async def Prefill(self, request, context):
        if self.prefill_core is None:
            raise ValueError("this worker does not serve prefills (role is not 'prefill')")
        params = params_from_proto(request.params)
        with _tracer.start_as_current_span(
            "prefill.handoff",
            context=context_from_grpc(context),
            kind=trace.SpanKind.SERVER,
            attributes=request_attributes(
                request.request_id, request.tenant, prompt_tokens=len(request.prompt_token_ids)
            )
            | {
                "yinian.transport": request.transport,
                "yinian.skipped_blocks": request.skip_blocks,
                "yinian.decode_worker_id": request.decode_worker_id,
            },
        ) as span:
            result = await self.prefill_core.prefill(
                request.request_id,
                list(request.prompt_token_ids),
                params,
                request.transport,
                request.transport_target,
                list(request.dst_block_ids),
                request.skip_blocks,
                tenant=request.tenant,
                priority=request.priority,
                lease_seconds=request.lease_seconds or 30.0,
            )
            span.set_attribute("yinian.kv_bytes", result.transfer_bytes)
            span.set_attribute("yinian.kv_blocks", result.num_blocks)
            span.set_attribute("yinian.kv_transfer_seconds", result.transfer_seconds)
            yield worker_pb2.PrefillChunk(
                layers_sent=self.prefill_core.num_layers,
                num_blocks=result.num_blocks,
                bytes=result.transfer_bytes,
                transfer_seconds=result.transfer_seconds,
                done=True,
                lease_id=result.lease_id,
                prefill_seconds=result.prefill_seconds,
                first_token_id=result.first_token_id,
                cached_tokens=result.cached_tokens,
                first_logprobs=common_pb2.PositionLogprobs(
                    chosen=common_pb2.TokenLogprob(
                        token_id=result.first_token_id, logprob=result.first_logprob
                    ),
                    top=[
                        common_pb2.TokenLogprob(token_id=t, logprob=lp, rank=r)
                        for t, lp, r in result.top_logprobs
                    ],
                ),
            )

    async def ReleaseKv(self, request, context):
        if self.prefill_core is None:
            return worker_pb2.ReleaseKvResponse(released=False)
        released = await self.prefill_core.release(request.lease_id)
        return worker_pb2.ReleaseKvResponse(released=released)
