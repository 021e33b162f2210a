"""/tokenize and /detokenize, as vLLM serves them: a prompt (or chat messages
through the template) to token ids, and token ids back to text."""

from __future__ import annotations

from fastapi import FastAPI, Request

from services.common.errors import InvalidRequest
from services.gateway.chat_protocol import ChatMessage, ToolDefinition
from services.gateway.gateway_core import GatewayCore
from services.gateway.openapi_doc import (
    DetokenizeResponse,
    TokenizeResponse,
    answers,
    request_body,
)
from services.gateway.protocol import StrictBody
from services.gateway.request_io import parse


class TokenizeRequest(StrictBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: list[int]


def add_tokenize_routes(app: FastAPI, core: GatewayCore, auth) -> None:
    def model_of(req) -> None:
        if req.model is not None:
            core.check_model(req.model)

    errors = (400, 401, 404, 408, 413)

    @app.post(
        "/tokenize",
        openapi_extra=request_body(TokenizeRequest),
        responses=answers(TokenizeResponse, *errors),
    )
    async def _tokenize(request: Request):
        auth.tenant(request.headers.get("authorization"))
        req = await parse(request, TokenizeRequest)
        model_of(req)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("send a prompt or messages (one of them)", param="prompt")
        if core.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer")
        if req.prompt is not None:
            special = req.add_special_tokens is not False
            tokens = await core.encode(req.prompt, special, bounded=False)
        else:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            messages = [m.template_message() for m in req.messages]
            text = await core.chat_text(
                messages, tools, add_generation_prompt=req.add_generation_prompt
            )
            tokens = await core.encode(text, bool(req.add_special_tokens), bounded=False)
        strs = [core.tokenizer.id_to_token(t) for t in tokens] if req.return_token_strs else None
        return {
            "count": len(tokens),
            "max_model_len": core.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }

    @app.post(
        "/detokenize",
        openapi_extra=request_body(DetokenizeRequest),
        responses=answers(DetokenizeResponse, *errors),
    )
    async def _detokenize(request: Request):
        auth.tenant(request.headers.get("authorization"))
        req = await parse(request, DetokenizeRequest)
        model_of(req)
        return {"prompt": core.detokenize(req.tokens)}
