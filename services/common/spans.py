"""Spans for stages measured after the fact (queue, prefill, decode) from the
monotonic clock the engine records, and the request attributes every
service puts on its spans (`gen_ai.*` where the conventions fit)."""

from __future__ import annotations

import time

from opentelemetry import trace

# Offset from the monotonic clock to Unix epoch nanoseconds, fixed at import.
_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def epoch_ns(monotonic_seconds: float) -> int:
    return _EPOCH_OFFSET_NS + int(monotonic_seconds * 1e9)


def stage_span(
    tracer: trace.Tracer,
    name: str,
    parent: trace.Span,
    start: float | None,
    end: float | None,
    **attributes,
) -> None:
    """Records a finished child span of `parent` between two monotonic times."""
    if start is None or end is None or end < start:
        return
    ctx = trace.set_span_in_context(parent)
    span = tracer.start_span(
        name,
        context=ctx,
        start_time=epoch_ns(start),
        attributes={k: v for k, v in attributes.items() if v is not None},
    )
    span.end(end_time=epoch_ns(end))


def request_attributes(
    request_id: str,
    tenant: str = "",
    model: str = "",
    prompt_tokens: int | None = None,
    max_tokens: int | None = None,
) -> dict:
    attrs = {
        "yinian.request_id": request_id,
        "yinian.tenant": tenant,
        "gen_ai.request.model": model,
        "gen_ai.operation.name": "text_completion",
    }
    if prompt_tokens is not None:
        attrs["gen_ai.usage.input_tokens"] = prompt_tokens
    if max_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = max_tokens
    return {k: v for k, v in attrs.items() if v not in ("", None)}
