"""The failures a caller can act on, and how each maps to a gRPC status and an
HTTP status (one table each; the gateway and the gRPC interceptor read them)."""

from __future__ import annotations

import grpc


class MeshError(Exception):
    """Base of the mesh's own errors."""


class InvalidRequest(MeshError, ValueError):
    """The request is malformed or out of range; retrying it will not help.
    `param` names the request field at fault, when one is (OpenAI's error.param)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PayloadTooLarge(InvalidRequest):
    """A request body over the size the gateway reads."""


class RequestTimeout(InvalidRequest):
    """The client took too long to send its request body."""


class Unauthenticated(MeshError):
    """A missing or unknown API key."""


class NotFound(MeshError):
    """An unknown model, request or worker."""


class Saturated(MeshError):
    """Every worker is busy; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class RateLimited(Saturated):
    """A tenant is over one of its limits (rate, tokens, concurrency); retry after
    `retry_after` seconds."""


class WorkerUnavailable(MeshError):
    """The worker serving the request went away or stopped answering."""


class DeadlineExceeded(MeshError):
    """A hop took longer than its deadline."""


class FailedPrecondition(MeshError):
    """Well formed, but this service cannot do it here (e.g. memory of another host)."""


GRPC_STATUS: dict[type[BaseException], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    ValueError: grpc.StatusCode.INVALID_ARGUMENT,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    NotFound: grpc.StatusCode.NOT_FOUND,
    Saturated: grpc.StatusCode.RESOURCE_EXHAUSTED,
    WorkerUnavailable: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
}

# (HTTP status, OpenAI error type)
HTTP_STATUS: dict[type[BaseException], tuple[int, str]] = {
    PayloadTooLarge: (413, "invalid_request_error"),
    RequestTimeout: (408, "invalid_request_error"),
    InvalidRequest: (400, "invalid_request_error"),
    ValueError: (400, "invalid_request_error"),
    Unauthenticated: (401, "authentication_error"),
    NotFound: (404, "not_found_error"),
    Saturated: (429, "rate_limit_error"),
    WorkerUnavailable: (503, "service_unavailable"),
    DeadlineExceeded: (504, "timeout"),
}

# gRPC status a downstream service returned -> our error type
FROM_GRPC: dict[grpc.StatusCode, type[MeshError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Saturated,
    grpc.StatusCode.UNAVAILABLE: WorkerUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: WorkerUnavailable,
}


def _lookup(table: dict, exc: BaseException):
    for cls in type(exc).__mro__:
        if cls in table:
            return table[cls]
    return None


def grpc_status_of(exc: BaseException) -> grpc.StatusCode:
    return _lookup(GRPC_STATUS, exc) or grpc.StatusCode.INTERNAL


def http_status_of(exc: BaseException) -> tuple[int, str]:
    return _lookup(HTTP_STATUS, exc) or (500, "internal_error")


def from_status(code: grpc.StatusCode, details: str = "") -> MeshError:
    """The mesh error a downstream status stands for."""
    return FROM_GRPC.get(code, WorkerUnavailable)(details or code.name)


STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def from_grpc_error(exc: grpc.RpcError) -> MeshError:
    """Turns a downstream gRPC failure into the matching mesh error."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return from_status(code, details)
