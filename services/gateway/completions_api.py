"""POST /v1/completions: one or several prompts (text or token ids), each with
n outputs, whole or streamed; `echo` puts the prompt before each output;
response_format and guided_* constrain the output."""

from __future__ import annotations

from fastapi import FastAPI, Request

from services.gateway import openai_format as fmt
from services.gateway.gateway_core import GatewayCore
from services.gateway.openai_run import serve
from services.gateway.openapi_doc import (
    RUN_ERRORS,
    CompletionResponse,
    answers,
    request_body,
)
from services.gateway.protocol import CompletionRequest, completion_prompts
from services.gateway.request_io import parse
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

        def whole(parts, stats):
            results = [r for part in parts for r in part]
            for i, r in enumerate(results):
                r.index = i
                r.text = echoes[i // n] + r.text
            return fmt.completion_response(request_id, req.model, results, stats)

        offsets: dict[int, int] = {}  # characters sent per output

        def chunks(which: int, ev):
            index = which * n + ev.index
            text = ev.text if index in offsets else echoes[which] + ev.text
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
            offsets[index] = offsets.get(index, 0) + len(text)
            return [chunk]

        return await serve(
            core, ROUTE, request, req, tenant, preps,
            whole=whole, chunks=chunks, chunk_object="text_completion",
        )  # fmt: skip
