"""Where a Generate call's time went, recorded in one place: the request's span
on this worker, its stages as child spans measured after the fact (queue,
prefill, kv_transfer, decode), the KV handoff metrics, and the StageTimings
the gateway receives with the last chunk."""

from __future__ import annotations

import time

from opentelemetry import context as otel_context
from opentelemetry import trace

from proto.yinian.v1 import worker_pb2
from services.common import metrics
from services.common.spans import request_attributes, stage_span
from services.common.telemetry import tracer
from services.decode.decode_core import RequestTiming
from services.worker.wire import Generate

_tracer = tracer("yinian.worker")


class GenerateTrace:
    """One Generate call: `with trace.active():` around the work (downstream calls
    join the trace), `stage_timings()` for the last chunk, `end()` when done."""

    def __init__(self, worker_id: str, call: Generate, parent):
        self.worker_id = worker_id
        self.timing = RequestTiming(arrival=time.monotonic())
        request = call.request
        self.span = _tracer.start_span(
            "worker.generate",
            context=parent,
            kind=trace.SpanKind.SERVER,
            attributes=request_attributes(
                request.request_id,
                request.namespace,
                prompt_tokens=len(request.prompt_ids),
                max_tokens=request.params.max_tokens,
            )
            | {
                "yinian.worker_id": worker_id,
                "yinian.resumed_tokens": len(call.resume_token_ids),
            },
        )
        metrics.WORKER_REQUESTS.labels(worker=worker_id).inc()

    async def next(self, stream):
        """The stream's next item, with this call's span current while it is made
        (downstream calls join the trace); StopAsyncIteration at the end. The span
        is never current while the caller is suspended, so a caller that goes away
        mid-stream closes it cleanly."""
        token = otel_context.attach(trace.set_span_in_context(self.span))
        try:
            return await anext(stream)
        finally:
            otel_context.detach(token)

    def stage_timings(self) -> worker_pb2.StageTimings:
        return timings_proto(self.timing)

    def end(self, finish: str | None) -> None:
        stage_spans(self.worker_id, self.span, self.timing)
        self.span.set_attribute("yinian.cached_tokens", self.timing.cached_tokens)
        self.span.set_attribute("gen_ai.usage.output_tokens", self.timing.output_tokens)
        if finish:
            self.span.set_attribute("gen_ai.response.finish_reasons", [finish])
        self.span.end()


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
    # the engine thread's first token until the service's loop has it (a wake-up, the GIL)
    stage_span(_tracer, "handover", span, timing.first_token, timing.first_received)
    stage_span(
        _tracer,
        "decode",
        span,
        timing.first_token,
        end,
        **{"gen_ai.usage.output_tokens": timing.output_tokens},
    )
