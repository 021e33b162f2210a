"""The OpenAI-compatible REST API (FastAPI): /v1/models, /v1/completions,
/v1/chat/completions (streamed as server-sent events ending in [DONE]),
/health and /metrics. Every failure is an OpenAI error body with its status."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from services.common.errors import InvalidRequest, http_status_of
from services.common.spans import request_attributes
from services.common.telemetry import tracer
from services.gateway import openai_format as fmt
from services.gateway.auth import Authenticator
from services.gateway.frontend import Prepared, RunStats
from services.gateway.gateway_core import GatewayCore
from services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    completion_prompts,
    error_body,
)

logger = logging.getLogger(__name__)
_tracer = tracer("yinian.gateway")


def error_response(exc: Exception) -> JSONResponse:
    status, err_type = http_status_of(exc)
    if status >= 500 and status != 503:
        logger.exception("request failed", exc_info=exc)
    headers = {}
    if hasattr(exc, "retry_after"):
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    return JSONResponse(
        error_body(str(exc) or type(exc).__name__, err_type, status),
        status_code=status,
        headers=headers,
    )


async def parse(request: Request, model: type[BaseModel]):
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidRequest(f"{where}: {first['msg']}") from exc


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


def create_app(
    core: GatewayCore, auth: Authenticator, health: Callable[[], Awaitable[bool]]
) -> FastAPI:
    app = FastAPI(title="yinian gateway")

    @app.exception_handler(Exception)
    async def _errors(request, exc):
        return error_response(exc)

    async def run_guarded(request: Request, coro):
        """Runs a non-streamed request, cancelling it if the client goes away."""
        task = asyncio.create_task(coro)
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()
        return task.result()

    def span_for(route: str, prep: Prepared, tenant: str):
        # FastAPI may already trace the HTTP request; this span carries the
        # request's own attributes beneath it (or is the root without it).
        outer = trace.get_current_span().get_span_context().is_valid
        return _tracer.start_as_current_span(
            "gateway.request",
            kind=trace.SpanKind.INTERNAL if outer else trace.SpanKind.SERVER,
            attributes=request_attributes(
                prep.request_id,
                tenant,
                core.model_name,
                len(prep.prompt_ids),
                prep.params.max_tokens,
            )
            | {"http.route": route},
        )

    @app.get("/health")
    async def _health():
        ready = await health()
        return JSONResponse(
            {"status": "ok" if ready else "unavailable"}, status_code=200 if ready else 503
        )

    @app.get("/metrics")
    async def _metrics():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def _models(request: Request):
        auth.tenant(request.headers.get("authorization"))
        return {
            "object": "list",
            "data": [
                {
                    "id": core.model_name,
                    "object": "model",
                    "owned_by": "yinian",
                    "max_model_len": core.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def _completions(request: Request):
        tenant = auth.tenant(request.headers.get("authorization"))
        req = await parse(request, CompletionRequest)
        core.check_model(req.model)
        if req.echo or req.suffix:
            raise InvalidRequest("echo and suffix are not supported")
        logprobs = req.logprobs
        if logprobs is not None and not 0 <= logprobs <= 5:
            raise InvalidRequest("logprobs must be between 0 and 5")
        preps = [
            core.prepare(
                core.tokenize(p),
                lambda m: req.sampling_params(m, logprobs),
                req.max_tokens,
                tenant,
                req.priority,
            )
            for p in completion_prompts(req.prompt)
        ]
        request_id, n = preps[0].request_id, req.n
        if not req.stream:

            async def whole():
                stats = [RunStats() for _ in preps]
                with span_for("/v1/completions", preps[0], tenant):
                    parts = await asyncio.gather(
                        *(core.collect(p, s) for p, s in zip(preps, stats))
                    )
                results = [r for i, part in enumerate(parts) for r in part]
                for i, r in enumerate(results):
                    r.index = i
                return fmt.completion_response(request_id, req.model, results, stats)

            return await run_guarded(request, whole())

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def stream():
            stats = [RunStats() for _ in preps]
            offsets: dict[int, int] = {}
            with span_for("/v1/completions", preps[0], tenant):
                try:
                    async for which, ev in merge([core.events(p, s) for p, s in zip(preps, stats)]):
                        index = which * n + ev.index
                        yield fmt.sse(
                            fmt.completion_chunk(
                                request_id,
                                req.model,
                                index,
                                ev.text,
                                ev.finish_reason,
                                ev.logprobs,
                                ev.stop_reason,
                                offsets.get(index, 0),
                            )
                        )
                        offsets[index] = offsets.get(index, 0) + len(ev.text)
                    if include_usage:
                        yield fmt.sse(
                            fmt.usage_chunk(request_id, req.model, "text_completion", stats)
                        )
                except Exception as exc:  # the stream already began: report in-band
                    status, err_type = http_status_of(exc)
                    yield fmt.sse(error_body(str(exc), err_type, status))
            yield fmt.sse("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def _chat(request: Request):
        tenant = auth.tenant(request.headers.get("authorization"))
        req = await parse(request, ChatCompletionRequest)
        core.check_model(req.model)
        top = req.top_logprobs
        if top is not None and not 0 <= top <= 20:
            raise InvalidRequest("top_logprobs must be between 0 and 20")
        logprobs = (top or 0) if req.logprobs else None
        prompt_ids = core.chat_prompt([{"role": m.role, "content": m.text()} for m in req.messages])
        max_tokens = req.max_completion_tokens or req.max_tokens
        prep = core.prepare(
            prompt_ids,
            lambda m: req.sampling_params(m, logprobs),
            max_tokens,
            tenant,
            req.priority,
            prefix="chatcmpl",
        )
        if not req.stream:

            async def whole():
                stats = RunStats()
                with span_for("/v1/chat/completions", prep, tenant):
                    results = await core.collect(prep, stats)
                return fmt.chat_response(prep.request_id, req.model, results, [stats])

            return await run_guarded(request, whole())

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def stream():
            stats = RunStats()
            with span_for("/v1/chat/completions", prep, tenant):
                for i in range(req.n):
                    yield fmt.sse(
                        fmt.chat_chunk(
                            prep.request_id,
                            req.model,
                            i,
                            {"role": "assistant", "content": ""},
                            None,
                        )
                    )
                try:
                    async for ev in core.events(prep, stats):
                        delta = {"content": ev.text} if ev.text or ev.finish_reason is None else {}
                        yield fmt.sse(
                            fmt.chat_chunk(
                                prep.request_id,
                                req.model,
                                ev.index,
                                delta,
                                ev.finish_reason,
                                ev.logprobs,
                                ev.stop_reason,
                            )
                        )
                    if include_usage:
                        yield fmt.sse(
                            fmt.usage_chunk(
                                prep.request_id, req.model, "chat.completion.chunk", [stats]
                            )
                        )
                except Exception as exc:
                    status, err_type = http_status_of(exc)
                    yield fmt.sse(error_body(str(exc), err_type, status))
            yield fmt.sse("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app
