"""The mesh's own calls, told from strangers': a per-mesh secret every internal
gRPC call carries (`x-yinian-mesh-token` metadata) and every internal server
checks, in constant time, before any method runs (UNAUTHENTICATED otherwise).
Health checks stay open (probes carry no secret); the gateway's public API
takes API keys instead.

The token comes from `YINIAN_MESH_TOKEN`: `yinian up` gives every service it
starts a credential of its own and the servers the table of them (callers.py:
a server knows which service calls, and what it may call); a deployment hands
every service one shared secret instead. A service started
without it serves and calls unauthenticated and says so at start; `yinian up
--insecure-internal` runs a whole mesh that way, with a warning in its banner.
"""

from __future__ import annotations

import hmac
import logging
import os
import time

import grpc

from services.common import callers

logger = logging.getLogger(__name__)
ENV = "YINIAN_MESH_TOKEN"
KEY = "x-yinian-mesh-token"
_OPEN = ("/grpc.health.v1.Health/",)


def token() -> str:
    return os.environ.get(ENV, "")


def warn_if_open(what: str) -> None:
    if not token():
        logger.warning("%s: no %s, so internal gRPC calls are not authenticated "
                       "(anyone who reaches this port may call it)", what, ENV)  # fmt: skip


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses every call without the mesh's token (health checks aside); with a
    callers' table, a call of a method its caller may not make (PERMISSION_DENIED)."""

    def __init__(self, expected: str, table: callers.CallerTable | None = None):
        self.expected = expected.encode()
        self.table = table

    async def intercept_service(self, continuation, details):
        if details.method.startswith(_OPEN):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get(KEY, "")
        if not isinstance(given, str):
            given = ""
        if self.table is None:
            if hmac.compare_digest(given.encode(), self.expected):
                return await continuation(details)
        else:
            caller = self.table.caller(given)
            if caller is not None and callers.permitted(caller, details.method):
                return await continuation(details)
            if caller is not None:
                _log_refusal(details.method, caller, " may not call it")
                return _refusal(
                    await continuation(details),
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{callers.role_of(caller)} services may not call this",
                )
        _log_refusal(details.method, "a wrong" if given else "no", " mesh token")
        return _refusal(await continuation(details))


def caller_of(context) -> str | None:
    """The mesh service that made this call (its guard checked the credential), or
    None on a server without a callers' table (one shared secret)."""
    if not os.environ.get(callers.ENV):
        return None
    credential = dict(context.invocation_metadata() or ()).get(KEY, "")
    return credential.partition(".")[0] or None


def speaks_for(context, name: str) -> bool:
    """Whether the caller may act as service `name`: itself, the mesh's owner, or
    any caller of a mesh with one shared secret."""
    caller = caller_of(context)
    return caller is None or caller in (callers.OWNER, name)


async def only_itself(context, name: str, kind: str) -> None:
    """Aborts (PERMISSION_DENIED) a call that speaks for service `name` from another
    service: a worker or expert registers and withdraws itself, no other."""
    if not speaks_for(context, name):
        logger.warning("refused: %s tried to speak for %s %s", caller_of(context), kind, name)
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"a {kind} may speak only for itself, not for {name!r}")  # fmt: skip


def guard() -> list:
    """The interceptors an internal server needs: none without a token."""
    if not token():
        return []
    return [TokenCheck(token(), callers.table())]


_logged: dict[str, float] = {}


def _log_refusal(method: str, who: str, what: str) -> None:
    """A warning per method a minute at most, however many calls a stranger makes."""
    now = time.monotonic()
    if now - _logged.get(method, -60.0) >= 60.0:
        _logged[method] = now
        logger.warning("refused %s: %s%s", method, who, what)


def _refusal(handler, code=grpc.StatusCode.UNAUTHENTICATED, why="not a call of this mesh"):
    """The handler of the same kind as `handler` that only refuses."""
    if handler is None:
        return None

    async def refuse(request, context):
        await context.abort(code, why)

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
