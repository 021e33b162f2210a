"""Starting an asyncio gRPC server the same way in every service: the
standard health service, server reflection, and one interceptor that maps
domain exceptions to status codes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.errors import grpc_status_of

logger = logging.getLogger(__name__)


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions raised by servicers into status codes (ValueError ->
    INVALID_ARGUMENT, Saturated -> RESOURCE_EXHAUSTED, ...)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary:  # a client stream answered once: awaited like a unary
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


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
    """An aio server with health and reflection; `serving(bool)` flips readiness."""

    def __init__(self, host: str, port: int):
        self.server = grpc.aio.server(
            interceptors=[ErrorMappingInterceptor()],
            options=[
                ("grpc.max_receive_message_length", 256 * 1024 * 1024),
                ("grpc.max_send_message_length", 256 * 1024 * 1024),
            ],
        )
        self.health = (
            health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names: list[str] = [health.SERVICE_NAME, reflection.SERVICE_NAME]
        self.port = self.server.add_insecure_port(f"{host}:{port}")
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
