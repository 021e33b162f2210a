"""The worker's gRPC servicer: decode the request, call the core, encode."""

from __future__ import annotations

import time

from opentelemetry import trace

from proto.yinian.v1 import common_pb2, scheduler_pb2, worker_pb2, worker_pb2_grpc
from services.common import metrics
from services.common.convert import finish_to_proto, params_from_proto
from services.common.spans import request_attributes, stage_span
from services.common.telemetry import context_from_grpc, tracer
from services.decode.worker_core import RequestTiming, TokenDelta, WorkerCore
from services.prefill.prefill_core import PrefillCore
from services.prefill.server import PrefillMethods

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


def timings_proto(timing: RequestTiming) -> worker_pb2.StageTimings:
    h = timing.handoff
    end_of_first = h.committed_at if h is not None and h.committed_at else timing.first_token
    out = worker_pb2.StageTimings(
        first_decode_seconds=(timing.second_token - end_of_first)
        if timing.second_token and end_of_first
        else 0.0
    )
    if h is not None and not h.fell_back:
        out.queue_seconds = h.queue_seconds
        out.prefill_seconds = h.prefill_seconds
        out.transfer_seconds = h.transfer_seconds
        out.transfer_bytes, out.transfer_blocks = h.transfer_bytes, h.transfer_blocks
        out.skipped_blocks, out.prefill_worker_id = h.skipped_blocks, h.prefill_worker_id
        out.transport = h.transport
    elif timing.first_scheduled is not None:
        out.queue_seconds = timing.first_scheduled - timing.arrival
        out.prefill_seconds = (timing.first_token or timing.first_scheduled) - (
            timing.first_scheduled
        )
    return out


def record_handoff(worker_id: str, h) -> None:
    if h.fell_back:
        metrics.KV_HANDOFF_FALLBACKS.labels(worker=worker_id).inc()
        return
    metrics.KV_TRANSFER_BLOCKS.labels(worker=worker_id, transport=h.transport).inc(
        h.transfer_blocks
    )
    metrics.KV_TRANSFER_BYTES.labels(worker=worker_id, transport=h.transport).inc(h.transfer_bytes)
    metrics.KV_SKIPPED_BLOCKS.labels(worker=worker_id).inc(h.skipped_blocks)
    metrics.KV_TRANSFER_SECONDS.observe(h.transfer_seconds)


def stage_spans(worker_id: str, span, timing: RequestTiming) -> None:
    """queue, prefill, (kv_transfer,) decode: the request's stages on this worker."""
    end = timing.finished or time.monotonic()
    h = timing.handoff
    if h is not None:
        record_handoff(worker_id, h)
    if h is not None and not h.fell_back and h.committed_at is not None:
        start = timing.arrival + h.queue_seconds
        stage_span(_tracer, "queue", span, timing.arrival, start)
        stage_span(
            _tracer,
            "prefill",
            span,
            start,
            start + h.prefill_seconds,
            **{"yinian.prefill_worker_id": h.prefill_worker_id},
        )
        stage_span(
            _tracer,
            "kv_transfer",
            span,
            start + h.prefill_seconds,
            h.committed_at,
            **{
                "yinian.transport": h.transport,
                "yinian.kv_bytes": h.transfer_bytes,
                "yinian.kv_blocks": h.transfer_blocks,
                "yinian.skipped_blocks": h.skipped_blocks,
            },
        )
        stage_span(
            _tracer,
            "decode",
            span,
            h.committed_at,
            end,
            **{"gen_ai.usage.output_tokens": timing.output_tokens},
        )
        return
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


class WorkerServicer(PrefillMethods, worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        core: WorkerCore,
        info: scheduler_pb2.WorkerInfo,
        prefill_core: PrefillCore | None = None,
    ):
        self.core = core
        self.info = info
        self.prefill_core = prefill_core

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
            with trace.use_span(span, end_on_exit=False):  # downstream calls join this trace
                async for delta in self.core.generate(
                    request.request_id,
                    list(request.prompt_token_ids),
                    params,
                    tenant=request.tenant,
                    priority=request.priority,
                    resume_token_ids=list(request.resume_token_ids),
                    timing=timing,
                    prefill_address=request.prefill_address,
                ):
                    finish = delta.finish_reason or finish
                    chunk = delta_to_chunk(request.request_id, delta)
                    if delta.finish_reason is not None:
                        chunk.timings.CopyFrom(timings_proto(timing))
                    yield chunk
        finally:
            stage_spans(self.core.worker_id, span, timing)
            span.set_attribute("yinian.cached_tokens", timing.cached_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", timing.output_tokens)
            if finish:
                span.set_attribute("gen_ai.response.finish_reasons", [finish])
            span.end()

    async def Abort(self, request, context):
        self.core.abort(request.request_id)
        return worker_pb2.AbortResponse(found=True)

    async def GetInfo(self, request, context):
        return self.info

    async def GetLoad(self, request, context):
        load = self.core.load()
        return common_pb2.LoadReport(
            **{
                k: v
                for k, v in load.items()
                if k in common_pb2.LoadReport.DESCRIPTOR.fields_by_name
            }
        )
