"""The guard around every HTTP request the gateway serves.

- Bodies are bounded in size: a Content-Length over the limit is answered 413 at
  once, without reading a byte of the body; a body sent without one is counted as it
  arrives and refused once it passes the limit. The rest is never held in memory.
- Bodies are bounded in time: a client that drips its body gets 408 once the body
  timeout passes (others are served meanwhile: each connection is its own task).
- Every failure is a response with OpenAI's error body, never an exception that
  leaves the app: uvicorn closes the connection on one, without telling the client,
  which then finds its next request on that keep-alive connection reset.
- An error answered before the whole body was read (413, 408, a bad length) says
  `Connection: close` and closes: the unread rest would otherwise be read as the
  connection's next request.
"""

from __future__ import annotations

import asyncio
import logging
import math

from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from services.common.errors import PayloadTooLarge, RequestTimeout, http_status_of
from services.gateway.protocol import error_body

logger = logging.getLogger(__name__)


def error_response(exc: Exception, close: bool = False) -> JSONResponse:
    """The OpenAI error response of an exception (Retry-After when it has one;
    `Connection: close` with `close`)."""
    status, err_type = http_status_of(exc)
    if status >= 500 and status != 503:
        logger.exception("request failed", exc_info=exc)
    headers = {"Connection": "close"} if close else {}
    if hasattr(exc, "retry_after"):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return JSONResponse(
        error_body(str(exc) or type(exc).__name__, err_type, status, getattr(exc, "param", None)),
        status_code=status,
        headers=headers,
    )


class _Body:
    """The request's `receive`, counting body bytes against the limit and the time
    the body takes against the timeout; once the body is in, it passes through."""

    def __init__(self, receive, max_bytes: int, timeout: float):
        self._receive = receive
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.read = 0
        self.done = False
        self.deadline: float | None = None

    async def receive(self):
        if self.done:
            return await self._receive()
        loop = asyncio.get_running_loop()
        if self.deadline is None:
            self.deadline = loop.time() + self.timeout
        try:
            message = await asyncio.wait_for(self._receive(), self.deadline - loop.time())
        except asyncio.TimeoutError:
            raise RequestTimeout(
                f"the request body did not arrive within {self.timeout:g} s"
            ) from None
        if message["type"] == "http.request":
            self.read += len(message.get("body", b""))
            if self.read > self.max_bytes:
                raise PayloadTooLarge(too_large(self.max_bytes))
            self.done = not message.get("more_body", False)
        else:
            self.done = True
        return message


def too_large(max_bytes: int) -> str:
    return f"the request body is larger than {max_bytes} bytes"


def _has_body(scope) -> bool:
    headers = dict(scope["headers"])
    length = headers.get(b"content-length")
    return b"transfer-encoding" in headers or (length is not None and length.strip() != b"0")


class HttpGuard:
    """ASGI middleware: size and time limits on bodies, errors as OpenAI bodies."""

    def __init__(self, app, max_body_bytes: int, body_timeout: float):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and int(length) > self.max_body_bytes:  # llhttp checked it
            exc = PayloadTooLarge(too_large(self.max_body_bytes))
            await error_response(exc, close=True)(scope, receive, send)
            return
        started = False

        async def sending(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        body = _Body(receive, self.max_body_bytes, self.body_timeout)
        try:
            await self.app(scope, body.receive, sending)
        except ClientDisconnect:  # the client left while sending: nobody to answer
            return
        except Exception as exc:  # noqa: BLE001 - every failure becomes a response
            if started:  # too late for a status: the response ends here, cut short
                logger.warning("response cut short by %r", exc)
                return
            unread = _has_body(scope) and not body.done
            await error_response(exc, close=unread)(scope, receive, send)
