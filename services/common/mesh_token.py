"""The mesh's own calls, told from strangers': a per-mesh secret every internal
gRPC call carries (`x-yinian-mesh-token` metadata) and every internal server
checks, in constant time, before any method runs (UNAUTHENTICATED otherwise).
Health checks stay open (probes carry no secret); the gateway's public API
takes API keys instead.

The token comes from `YINIAN_MESH_TOKEN`: `yinian up` makes one per run and
hands it to every service it starts (deployments: a secret). A service started
without it serves and calls unauthenticated and says so at start; `yinian up
--insecure-internal` runs a whole mesh that way, with a warning in its banner.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import time

import grpc

logger = logging.getLogger(__name__)
ENV = "YINIAN_MESH_TOKEN"
KEY = "x-yinian-mesh-token"
_OPEN = ("/grpc.health.v1.Health/",)


def token() -> str:
    return os.environ.get(ENV, "")


def new_token() -> str:
    return secrets.token_urlsafe(32)


def warn_if_open(what: str) -> None:
    if not token():
        logger.warning("%s: no %s, so internal gRPC calls are not authenticated "
                       "(anyone who reaches this port may call it)", what, ENV)  # fmt: skip


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses every call without the mesh's token (health checks aside)."""

    def __init__(self, expected: str):
        self.expected = expected.encode()

    async def intercept_service(self, continuation, details):
        if details.method.startswith(_OPEN):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get(KEY, "")
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self.expected):
            return await continuation(details)
        _log_refusal(details.method, "a wrong" if given else "no")
        return _refusal(await continuation(details))


_logged: dict[str, float] = {}


def _log_refusal(method: str, which: str) -> None:
    """A warning per method a minute at most, however many calls a stranger makes."""
    now = time.monotonic()
    if now - _logged.get(method, -60.0) >= 60.0:
        _logged[method] = now
        logger.warning("refused %s: %s mesh token", method, which)


def _refusal(handler):
    """The handler of the same kind as `handler` that only refuses."""
    if handler is None:
        return None

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "not a call of this mesh")

    async def refuse_stream(request, context):
        await refuse(request, context)
        yield  # pragma: no cover - abort raises

    kinds = [
        (handler.unary_unary, grpc.unary_unary_rpc_method_handler, refuse),
        (handler.unary_stream, grpc.unary_stream_rpc_method_handler, refuse_stream),
        (handler.stream_unary, grpc.stream_unary_rpc_method_handler, refuse),
        (handler.stream_stream, grpc.stream_stream_rpc_method_handler, refuse_stream),
    ]
    make, behaviour = next((m, b) for served, m, b in kinds if served)
    return make(behaviour, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)  # fmt: skip


def _with_token(details):
    return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), (KEY, token())))


# asyncio channels file each interceptor under one kind of call only (the first
# kind it is an instance of): one class per kind
class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_token(details), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_token(details), request)


class _AioStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_with_token(details), request_iterator)


class _AioStreamStream(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_with_token(details), request_iterator)


class _SyncToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_sync_details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_sync_details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(_sync_details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(_sync_details(details), request_iterator)


class _SyncDetails(grpc.ClientCallDetails):
    def __init__(self, details, metadata):
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


def _sync_details(details):
    return _SyncDetails(details, [*(details.metadata or ()), (KEY, token())])


def aio_interceptors() -> list:
    """What an asyncio channel needs to carry the token (none without one)."""
    kinds = (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)
    return [kind() for kind in kinds] if token() else []


def sync_intercept(channel: grpc.Channel) -> grpc.Channel:
    return grpc.intercept_channel(channel, _SyncToken()) if token() else channel
