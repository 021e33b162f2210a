"""The OpenAI-compatible REST API (FastAPI): /v1/models, /v1/completions
(completions_api), /v1/chat/completions (chat_api; streamed as server-sent
events ending in [DONE]), /tokenize and /detokenize (tokenize_api), /health
and /metrics. Every failure, an unknown route included, is an OpenAI error
body with its status."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from services.common import metrics
from services.common.errors import NotFound
from services.gateway.auth import Authenticator
from services.gateway.chat_api import add_chat_route
from services.gateway.completions_api import add_completions_route
from services.gateway.gateway_core import GatewayCore
from services.gateway.http_guard import HttpGuard
from services.gateway.openapi_doc import ModelCard, ModelList, Status, answers, install
from services.gateway.protocol import error_body
from services.gateway.tokenize_api import add_tokenize_routes

logger = logging.getLogger(__name__)
_HTTP_ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error"}


def create_app(
    core: GatewayCore,
    auth: Authenticator,
    health: Callable[[], Awaitable[bool]],
    max_body_bytes: int = 16 << 20,
    body_timeout: float = 30.0,
) -> FastAPI:
    app = FastAPI(title="yinian gateway")
    # Route errors become responses here (http_guard.py), never exceptions that
    # reach uvicorn: those close the client's keep-alive connection.
    app.add_middleware(HttpGuard, max_body_bytes=max_body_bytes, body_timeout=body_timeout)

    @app.exception_handler(HTTPException)
    async def _http_errors(request, exc: HTTPException):
        # Starlette's own answers (no such route, method not allowed) in OpenAI's shape.
        err_type = _HTTP_ERROR_TYPES.get(exc.status_code, "invalid_request_error")
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return JSONResponse(
            error_body(message, err_type, exc.status_code),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    install(app, core.model_name)  # the request bodies in /openapi.json

    @app.get("/health/live", responses=answers(Status))
    async def _live():  # the process answers; readiness is /health/ready
        return {"status": "ok"}

    readiness = {200: {"model": Status}, 503: {"model": Status, "description": "not ready"}}

    @app.get("/health", responses=readiness)
    @app.get("/health/ready", responses=readiness)
    async def _health():
        ready = await health()
        return JSONResponse(
            {"status": "ok" if ready else "unavailable"}, status_code=200 if ready else 503
        )

    @app.get("/metrics", response_class=PlainTextResponse)
    async def _metrics():
        return Response(generate_latest(metrics.GATEWAY), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {
            "id": core.model_name,
            "object": "model",
            "created": core.created,
            "owned_by": "yinian",
            "root": core.model_root,
            "max_model_len": core.max_model_len,
        }

    @app.get("/v1/models", responses=answers(ModelList, 401))
    async def _models(request: Request):
        auth.tenant(request.headers.get("authorization"))
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", responses=answers(ModelCard, 401, 404))
    async def _model(request: Request, model_id: str):
        auth.tenant(request.headers.get("authorization"))
        if model_id != core.model_name:
            raise NotFound(f"The model `{model_id}` does not exist.")
        return model_card()

    add_completions_route(app, core, auth)
    add_chat_route(app, core, auth)
    add_tokenize_routes(app, core, auth)
    return app
