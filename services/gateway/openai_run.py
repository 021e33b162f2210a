"""The one skeleton of an OpenAI generating call, shared by /v1/completions and
/v1/chat/completions: the prepared requests admitted under their tenant's
limits, then run whole (cancelled if the client leaves) or streamed as
server-sent events (the request's span around the run, an error after the
stream began reported in-band, usage when asked, `[DONE]` last). A route says
only how its body becomes prepared requests and how results become its
objects."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from fastapi import Request

from services.common.errors import http_status_of
from services.gateway import openai_format as fmt
from services.gateway.frontend import ChoiceEvent, Prepared, RunStats
from services.gateway.gateway_core import ChoiceResult, GatewayCore
from services.gateway.protocol import error_body
from services.gateway.request_io import (
    HeldStream,
    gather_or_cancel,
    merge,
    request_span,
    run_guarded,
)

# (which prepared request, its event) -> the chunks to send
ChunksOf = Callable[[int, ChoiceEvent], Iterable[dict]]
# (each prepared request's results, each one's stats) -> the whole response
WholeOf = Callable[[list[list[ChoiceResult]], list[RunStats]], dict]


async def serve(
    core: GatewayCore,
    route: str,
    request: Request,
    req,
    tenant: str,
    preps: list[Prepared],
    *,
    whole: WholeOf,
    chunks: ChunksOf,
    chunk_object: str,
    opening: Iterable[dict] = (),
):
    """The route's answer for `req` (its parsed body): `whole(...)` when it does
    not stream, else an event stream of `opening`, then `chunks(...)` of each
    event, then the usage chunk (`chunk_object` names its object) if asked."""
    ticket = await core.admission.admit(tenant, preps)  # the last check: then it runs
    first = preps[0]
    if not req.stream:

        async def run_whole():
            stats = [RunStats() for _ in preps]
            with request_span(core, route, first, tenant, req):
                parts = await gather_or_cancel(core.collect(p, s) for p, s in zip(preps, stats))
            return whole(parts, stats)

        return await run_guarded(request, run_whole(), ticket)

    options = req.stream_options
    include_usage = bool(options and options.include_usage)
    obfuscate = bool(options and options.include_obfuscation)
    continuous = include_usage and bool(options and options.continuous_usage_stats)
    stats = [RunStats(prompt_tokens=len(p.prompt_ids)) for p in preps]

    def sse(chunk: dict) -> str:
        if continuous:
            chunk["usage"] = fmt.usage(stats)
        return fmt.sse(fmt.obfuscated(chunk) if obfuscate else chunk)

    async def stream():
        with request_span(core, route, first, tenant, req):
            for chunk in opening:
                yield sse(chunk)
            try:
                events = merge([core.events(p, s) for p, s in zip(preps, stats)])
                async for which, ev in events:
                    for chunk in chunks(which, ev):
                        yield sse(chunk)
                if include_usage:
                    yield fmt.sse(fmt.usage_chunk(first.request_id, req.model, chunk_object, stats))
            except Exception as exc:  # the stream already began: report in-band
                status, err_type = http_status_of(exc)
                yield fmt.sse(error_body(str(exc), err_type, status))
        yield fmt.sse("[DONE]")

    return HeldStream(stream(), ticket)
