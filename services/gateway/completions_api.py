"""POST /v1/completions: one or several prompts (text or token ids), each with
n outputs, whole or streamed; `echo` puts the prompt before each output;
response_format and guided_* constrain the output."""

from __future__ import annotations

from fastapi import FastAPI, Request

from services.common.errors import http_status_of
from services.gateway import openai_format as fmt
from services.gateway.frontend import RunStats
from services.gateway.gateway_core import GatewayCore
from services.gateway.openapi_doc import (
    RUN_ERRORS,
    CompletionResponse,
    answers,
    request_body,
)
from services.gateway.protocol import CompletionRequest, completion_prompts, error_body
from services.gateway.request_io import (
    HeldStream,
    gather_or_cancel,
    merge,
    parse,
    request_span,
    run_guarded,
)
from services.gateway.structured_request import structured_output

ROUTE = "/v1/completions"


def add_completions_route(app: FastAPI, core: GatewayCore, auth) -> None:
    @app.post(
        ROUTE,
        openapi_extra=request_body(CompletionRequest),
        responses=answers(CompletionResponse, *RUN_ERRORS, stream=True),
    )
    async def _completions(request: Request):
        tenant = auth.tenant(request.headers.get("authorization"))
        req = await parse(request, CompletionRequest)
        core.check_model(req.model)
        structured = structured_output(req)
        prompts = completion_prompts(req.prompt)
        preps = [
            core.prepare(
                await core.tokenize(p),
                lambda m: req.sampling_params(m, req.logprobs, structured),
                req.max_tokens,
                tenant,
                req.priority,
            )
            for p in prompts
        ]
        request_id, n = preps[0].request_id, req.n
        # echo: each output starts with its prompt's text
        echoes = [
            "" if not req.echo else p if isinstance(p, str) else core.detokenize(p) for p in prompts
        ]
        ticket = await core.admission.admit(tenant, preps)  # the last check: then it runs
        if not req.stream:

            async def whole():
                stats = [RunStats() for _ in preps]
                with request_span(core, ROUTE, preps[0], tenant, req):
                    parts = await gather_or_cancel(core.collect(p, s) for p, s in zip(preps, stats))
                results = [r for part in parts for r in part]
                for i, r in enumerate(results):
                    r.index = i
                    r.text = echoes[i // n] + r.text
                return fmt.completion_response(request_id, req.model, results, stats)

            return await run_guarded(request, whole(), ticket)

        options = req.stream_options
        include_usage = bool(options and options.include_usage)
        obfuscate = bool(options and options.include_obfuscation)

        async def stream():
            stats = [RunStats() for _ in preps]
            offsets: dict[int, int] = {}
            with request_span(core, ROUTE, preps[0], tenant, req):
                try:
                    async for which, ev in merge([core.events(p, s) for p, s in zip(preps, stats)]):
                        index = which * n + ev.index
                        text = ev.text
                        if index not in offsets:
                            text = echoes[which] + text
                        chunk = fmt.completion_chunk(
                            request_id,
                            req.model,
                            index,
                            text,
                            ev.finish_reason,
                            ev.logprobs,
                            ev.stop_reason,
                            offsets.get(index, 0),
                        )
                        yield fmt.sse(fmt.obfuscated(chunk) if obfuscate else chunk)
                        offsets[index] = offsets.get(index, 0) + len(text)
                    if include_usage:
                        yield fmt.sse(
                            fmt.usage_chunk(request_id, req.model, "text_completion", stats)
                        )
                except Exception as exc:  # the stream already began: report in-band
                    status, err_type = http_status_of(exc)
                    yield fmt.sse(error_body(str(exc), err_type, status))
            yield fmt.sse("[DONE]")

        return HeldStream(stream(), ticket)
