"""The gateway's OpenAPI document (/openapi.json) as the routes really are: each
POST route's body is the pydantic model its handler parses (protocol.py,
chat_protocol.py, tokenize_api.py), and each route lists the answers it gives, with
their bodies. Routes read their bodies themselves (for OpenAI's error bodies and the
guards in http_guard.py), so the bodies are declared here rather than inferred.
Fuzzers (schemathesis) generate requests from this document and check the answers
against it."""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"
_MODELS: dict[str, type[BaseModel]] = {}  # request bodies, by schema name


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int | str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict | None
    finish_reason: Literal["stop", "length", "abort", "error", "tool_calls"] | None
    stop_reason: str | int | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[dict] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict | None
    finish_reason: Literal["stop", "length", "abort", "error", "tool_calls"] | None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str  # the model folder the gateway serves
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str


class Status(BaseModel):
    status: Literal["ok", "unavailable"]


_ERRORS = {
    400: "the request is malformed or out of range",
    401: "a missing or unknown API key",
    404: "no such model",
    408: "the body took longer than the body timeout",
    413: "the body is over the size limit",
    429: "the tenant is over a limit, or every worker is busy (see Retry-After)",
    503: "no worker could serve the request",
    504: "a worker took longer than its deadline",
}

RUN_ERRORS = (400, 401, 404, 408, 413, 429, 503, 504)  # what a request that runs may get
# One server-sent event (OpenAPI before 3.2: the schema of a stream is its events'):
# `data` is a JSON chunk, an error body, or [DONE] at the end.
_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
}


def answers(ok: type[BaseModel], *codes: int, stream: bool = False) -> dict:
    """A route's `responses`: `ok` on 200 (and server-sent events when it streams),
    OpenAI's error body on each of `codes`."""
    content = {"text/event-stream": {"schema": _EVENT}} if stream else {}
    responses: dict = {200: {"model": ok, "content": content} if content else {"model": ok}}
    for code in codes:
        responses[code] = {"model": ErrorBody, "description": _ERRORS[code]}
    return responses


def request_body(model: type[BaseModel]) -> dict:
    """A route's `openapi_extra`: its JSON body is `model`."""
    _MODELS[model.__name__] = model
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install(app: FastAPI, model_name: str) -> None:
    """Adds the request bodies' schemas to the app's document; `model` names the one
    model served (any other is a 404)."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = build()
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for name, model in _MODELS.items():
            schema = model.model_json_schema(ref_template=_REF, mode="validation")
            schemas.update(schema.pop("$defs", {}))
            schemas[name] = schema
            field = schema["properties"].get("model")
            if field is not None and field.get("type") == "string":
                field["enum"] = [model_name]
            elif field is not None:  # optional: the name or null
                field["anyOf"] = [{"type": "string", "enum": [model_name]}, {"type": "null"}]
        app.openapi_schema = document
        return document

    app.openapi = openapi
