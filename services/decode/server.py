"""The worker's gRPC servicer: decode the request, call the core, encode."""

from __future__ import annotations

import time

from opentelemetry import trace

from proto.yinian.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common import metrics
from services.common.convert import finish_to_proto, params_from_proto
from services.common.spans import request_attributes, stage_span
from services.common.telemetry import context_from_grpc, tracer
from services.decode.worker_core import RequestTiming, TokenDelta, WorkerCore

_tracer = tracer("yinian.worker")


def delta_to_chunk(request_id: str, delta: TokenDelta) -> worker_pb2.GenerateChunk:
    chunk = worker_pb2.GenerateChunk(
        request_id=request_id,
        index=delta.index,
        token_ids=delta.token_ids,
        finish_reason=finish_to_proto(delta.finish_reason),
        stop_reason=delta.stop_reason,
        prompt_tokens=delta.prompt_tokens,
        cached_tokens=delta.cached_tokens,
        error=delta.error,
    )
    for chosen, logprob, rank, top in delta.logprobs or ():
        chunk.logprobs.append(
            common_pb2.PositionLogprobs(
                chosen=common_pb2.TokenLogprob(token_id=chosen, logprob=logprob, rank=rank),
                top=[common_pb2.TokenLogprob(token_id=t, logprob=lp, rank=r) for t, lp, r in top],
            )
        )
    return chunk


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, core: WorkerCore):
        self.core = core

    async def Generate(self, request, context):
        params = params_from_proto(request.params)
        parent = context_from_grpc(context)
        span = _tracer.start_span(
            "worker.generate",
            context=parent,
            kind=trace.SpanKind.SERVER,
            attributes=request_attributes(
                request.request_id,
                request.tenant,
                prompt_tokens=len(request.prompt_token_ids),
                max_tokens=params.max_tokens,
            )
            | {
                "yinian.worker_id": self.core.worker_id,
                "yinian.resumed_tokens": len(request.resume_token_ids),
            },
        )
        timing = RequestTiming(arrival=time.monotonic())
        metrics.WORKER_REQUESTS.labels(worker=self.core.worker_id).inc()
        finish = None
        try:
            async for delta in self.core.generate(
                request.request_id,
                list(request.prompt_token_ids),
                params,
                tenant=request.tenant,
                priority=request.priority,
                resume_token_ids=list(request.resume_token_ids),
                timing=timing,
            ):
                finish = delta.finish_reason or finish
                yield delta_to_chunk(request.request_id, delta)
        finally:
            end = timing.finished or time.monotonic()
            stage_span(_tracer, "queue", span, timing.arrival, timing.first_scheduled)
            stage_span(
                _tracer,
                "prefill",
                span,
                timing.first_scheduled,
                timing.first_token,
                **{"yinian.cached_tokens": timing.cached_tokens},
            )
            stage_span(
                _tracer,
                "decode",
                span,
                timing.first_token,
                end,
                **{"gen_ai.usage.output_tokens": timing.output_tokens},
            )
            span.set_attribute("yinian.cached_tokens", timing.cached_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", timing.output_tokens)
            if finish:
                span.set_attribute("gen_ai.response.finish_reasons", [finish])
            span.end()

    async def Abort(self, request, context):
        self.core.abort(request.request_id)
        return worker_pb2.AbortResponse(found=True)

    async def GetLoad(self, request, context):
        load = self.core.load()
        return common_pb2.LoadReport(
            **{
                k: v
                for k, v in load.items()
                if k in common_pb2.LoadReport.DESCRIPTOR.fields_by_name
            }
        )
