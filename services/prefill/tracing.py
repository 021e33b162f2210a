"""The prefill service's trace of one handoff: a span joined to the decode
worker's trace, with what moved and how long it took."""

from __future__ import annotations

import contextlib

from opentelemetry import trace

from services.common.spans import request_attributes
from services.common.telemetry import context_from_grpc, tracer
from services.worker.handoff import PrefillResult

_tracer = tracer("yinian.prefill")


@contextlib.contextmanager
def handoff_span(request, context):
    """The span of one Prefill call; `record(result)` on it adds the outcome."""
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
        yield _Recorder(span)


class _Recorder:
    def __init__(self, span):
        self.span = span

    def record(self, result: PrefillResult) -> None:
        self.span.set_attribute("yinian.kv_bytes", result.transfer_bytes)
        self.span.set_attribute("yinian.kv_blocks", result.num_blocks)
        self.span.set_attribute("yinian.kv_transfer_seconds", result.transfer_seconds)
