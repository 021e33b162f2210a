"""What every REST route does around its own work: parse and check the body (read
by json_body.py), run a non-streamed request (cancelled if the client leaves) or
stream one (either holding its admission until it ends), merge several streams,
and open the request's span with what the client said about it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from opentelemetry import trace
from pydantic import BaseModel, ValidationError

from services.common.errors import InvalidRequest
from services.common.spans import request_attributes
from services.common.telemetry import tracer
from services.gateway.admission import Ticket
from services.gateway.frontend import Prepared
from services.gateway.json_body import decode_json

_tracer = tracer("yinian.gateway")


async def parse(request: Request, model: type[BaseModel]):
    """The body as `model`, checked (its `check()`); InvalidRequest naming the field."""
    body = decode_json(await request.body())
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    try:
        parsed = model.model_validate(body)
    except ValidationError as exc:
        # Of a union's errors, the one about the value's own type says what is wrong
        # ("at most 64 items"), not that it is not one of the other types.
        errors = exc.errors()
        first = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
        where = ".".join(str(p) for p in first["loc"])
        param = str(first["loc"][0]) if first["loc"] else None
        if first["type"] == "extra_forbidden":
            raise InvalidRequest(f"unknown field `{where}`: not supported", param=param) from exc
        raise InvalidRequest(f"{where}: {first['msg']}", param=param) from exc
    check = getattr(parsed, "check", None)
    if check is not None:
        check()
    return parsed


async def run_guarded(request: Request, coro, ticket: Ticket):
    """Runs a non-streamed request, cancelling it if the client goes away; its
    admission ticket is released when it ends."""
    task = asyncio.create_task(coro)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()
        return task.result()
    finally:
        task.cancel()
        await ticket.release()


async def gather_or_cancel(coros) -> list:
    """Runs the coroutines together; the first failure cancels the others (and waits
    for them to stop) before it is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class HeldStream(StreamingResponse):
    """A streamed answer (server-sent events) that releases its admission ticket
    when it ends, however it ends (its last chunk, an error, a client that left),
    and closes its generator then."""

    def __init__(self, content, ticket: Ticket):
        super().__init__(content, media_type="text/event-stream")
        self.ticket = ticket

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                await self.ticket.release()


async def merge(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Interleaves several async iterators: (which, item); an error in any ends all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, stream):
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put((i, done))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def client_annotations(req) -> dict:
    """`user`, `safety_identifier` and `metadata` of a request, as span attributes."""
    attrs = {}
    if getattr(req, "user", None):
        attrs["enduser.id"] = req.user
    if getattr(req, "safety_identifier", None):
        attrs["yinian.safety_identifier"] = req.safety_identifier
    for key, value in (getattr(req, "metadata", None) or {}).items():
        attrs[f"yinian.metadata.{key}"] = value
    return attrs


def request_span(core, route: str, prep: Prepared, tenant: str, req=None):
    """The request's span. FastAPI may already trace the HTTP request; this span
    carries the request's own attributes beneath it (or is the root without it)."""
    outer = trace.get_current_span().get_span_context().is_valid
    attributes = request_attributes(
        prep.request_id, tenant, core.model_name, len(prep.prompt_ids), prep.params.max_tokens
    )
    return _tracer.start_as_current_span(
        "gateway.request",
        kind=trace.SpanKind.INTERNAL if outer else trace.SpanKind.SERVER,
        attributes=attributes | {"http.route": route} | client_annotations(req),
    )
