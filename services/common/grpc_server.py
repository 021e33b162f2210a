"""Starting an asyncio gRPC server the same way in every service: the
standard health service, server reflection, one interceptor that maps
domain exceptions to status codes and one that counts open calls (a draining
worker waits for them), optional TLS (services/common/tls.py), and a port of
its own: never shared with another process, a taken one is a one-line error."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import mesh_token
from services.common.errors import grpc_status_of
from services.common.processes import check_port_free
from services.common.tls import TlsFiles, check_readable

logger = logging.getLogger(__name__)


def rewrap(handler, wrap_unary, wrap_stream):
    """The handler with its behaviour wrapped: `wrap_unary` for calls answered once,
    `wrap_stream` for server streams (bidirectional streams are left as they are)."""
    if handler is None:
        return None
    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary), **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap_stream(handler.unary_stream), **kwargs)
    if handler.stream_unary:  # a client stream answered once: awaited like a unary
        return grpc.stream_unary_rpc_method_handler(wrap_unary(handler.stream_unary), **kwargs)
    return handler


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions raised by servicers into status codes (ValueError ->
    INVALID_ARGUMENT, Saturated -> RESOURCE_EXHAUSTED, ...)."""

    async def intercept_service(self, continuation, handler_call_details):
        return rewrap(await continuation(handler_call_details), _wrap_unary, _wrap_stream)


class InFlight(grpc.aio.ServerInterceptor):
    """Counts the calls being served, health checks and reflection aside."""

    def __init__(self):
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def _enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def _exit(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler_call_details.method.startswith("/grpc."):
            return handler

        def unary(behavior):
            async def counted(request, context):
                self._enter()
                try:
                    return await behavior(request, context)
                finally:
                    self._exit()

            return counted

        def stream(behavior):
            async def counted(request, context):
                self._enter()
                try:
                    async for item in behavior(request, context):
                        yield item
                finally:
                    self._exit()

            return counted

        return rewrap(handler, unary, stream)

    @contextlib.contextmanager
    def holding(self):
        """Counts what runs inside as an open call (a request of a multiplexed call)."""
        self._enter()
        try:
            yield
        finally:
            self._exit()

    async def wait_idle(self, timeout: float) -> bool:
        """True once no call is open, False if some still are after `timeout`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


async def _abort(context, exc: Exception):
    code = grpc_status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.exception("unhandled error in gRPC method", exc_info=exc)
    await context.abort(code, str(exc) or type(exc).__name__)


def _wrap_unary(behavior):
    async def wrapped(request, context):
        try:
            return await behavior(request, context)
        except (grpc.aio.AbortError, grpc.RpcError):
            raise
        except Exception as exc:
            await _abort(context, exc)

    return wrapped


def _wrap_stream(behavior):
    async def wrapped(request, context):
        try:
            async for item in behavior(request, context):
                yield item
        except (grpc.aio.AbortError, grpc.RpcError):
            raise
        except Exception as exc:
            await _abort(context, exc)

    return wrapped


class GrpcServer:
    """An aio server with health and reflection; `serving(bool)` flips readiness.
    With `tls`, clients must show a certificate of its CA unless
    `require_client_cert` is False (a public endpoint). An `internal` server
    refuses calls without the mesh's token (mesh_token.py). Larger requests than
    `max_message_bytes` are refused (RESOURCE_EXHAUSTED) before they are parsed."""

    def __init__(
        self,
        host: str,
        port: int,
        tls: TlsFiles | None = None,
        require_client_cert: bool = True,
        what: str = "gRPC",
        max_message_bytes: int = 256 * 1024 * 1024,
        internal: bool = True,
    ):
        check_port_free(host, port, what)  # before gRPC logs a bind failure of its own
        check_readable(tls)
        self.in_flight = InFlight()
        # an internal server takes calls of this mesh only (mesh_token.py)
        guard = []
        if internal:
            mesh_token.warn_if_open(what)
            guard = mesh_token.guard()
        self.server = grpc.aio.server(
            interceptors=[*guard, self.in_flight, ErrorMappingInterceptor()],
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", 256 * 1024 * 1024),
                # gRPC shares ports by default: a second server on a taken port would
                # bind and split the traffic silently.
                ("grpc.so_reuseport", 0),
            ],
        )
        self.health = (
            health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names: list[str] = [health.SERVICE_NAME, reflection.SERVICE_NAME]
        try:
            if tls is None:
                self.port = self.server.add_insecure_port(f"{host}:{port}")
            else:
                credentials = tls.server_credentials(require_client_cert)
                self.port = self.server.add_secure_port(f"{host}:{port}", credentials)
        except RuntimeError:  # taken between the check and the bind
            check_port_free(host, port, what)
            raise
        self.address = f"{host}:{self.port}"

    def add(self, add_fn: Callable, servicer, service_names: Iterable[str]) -> None:
        add_fn(servicer, self.server)
        self.service_names.extend(service_names)

    async def start(self) -> None:
        reflection.enable_server_reflection(self.service_names, self.server)
        await self.server.start()

    async def serving(self, ready: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.service_names]:
            result = self.health.set(name, status)
            if hasattr(result, "__await__"):
                await result

    async def stop(self, grace: float = 2.0) -> None:
        await self.server.stop(grace)
