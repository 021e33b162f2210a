"""The gateway's HTTP/1.1 connections: uvicorn's httptools protocol (llhttp, in C: on
this project's 2-core machine a streamed token cost the gateway 42-51 µs of CPU against
48-58 µs with uvicorn's h11 protocol, bench.mesh_overhead at 64 streams, four runs
each) with the limits it lacks, so that no client can hold the gateway's connections,
file descriptors or memory.

- **Header timeout**: a connection must send a request's whole head (request line
  and headers) within `header_timeout` seconds of opening, or of its last
  response: one that sends nothing is closed; one that sent part of a head gets
  `408` and is closed. (uvicorn closes a connection idle after a response only
  if it stays silent: one byte disarmed that, and a new connection had no timer.)
- **Idle timeout**: between requests a keep-alive connection is closed after
  `keep_alive` seconds of silence (uvicorn's own timer).
- **Head size**: a request's head (request line and headers) larger than
  MAX_HEAD_BYTES is answered `431` and the connection closed (llhttp keeps every
  header it is given).
- **Connection cap**: past `max_connections` open connections a new one is
  answered `503` with OpenAI's error body and closed at once, so descriptors stay
  bounded and the client learns why.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from services.gateway.protocol import error_body

logger = logging.getLogger(__name__)


_refused = {"count": 0, "logged": 0.0}


def _log_refusal(cap: int) -> None:
    """One warning every 10 s at most, however many connections a flood brings."""
    _refused["count"] += 1
    now = time.monotonic()
    if now - _refused["logged"] >= 10.0:
        logger.warning(
            "%d connection(s) refused: %d open, --max-connections", _refused["count"], cap
        )
        _refused["count"], _refused["logged"] = 0, now


def _raw_response(status: int, reason: str, message: str, err_type: str) -> bytes:
    body = json.dumps(error_body(message, err_type, status)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


MAX_HEAD_BYTES = 64 * 1024


class GuardedProtocol(HttpToolsProtocol):
    """Set `header_timeout` and `max_connections` on a subclass (see `protocol`)."""

    header_timeout: float = 10.0
    max_connections: int = 10_000

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # of a head begun, not finished
        # requests whose head came, and those answered: equal while the next head is awaited
        self._heads = self._answered = 0
        if len(self.connections) > self.max_connections:
            _log_refusal(self.max_connections)
            transport.write(_raw_response(
                503, "Service Unavailable",
                f"the gateway holds {self.max_connections} connections, its limit; retry later",
                "service_unavailable",
            ))  # fmt: skip
            transport.close()
            return
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _waiting_for_head(self) -> bool:
        return self._heads == self._answered

    def on_headers_complete(self) -> None:
        self._heads += 1
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self._waiting_for_head():  # a head begun, not finished: its clock runs on
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self.transport.write(_raw_response(
                    431, "Request Header Fields Too Large",
                    f"a request's head must be within {MAX_HEAD_BYTES} bytes",
                    "invalid_request_error",
                ))  # fmt: skip
                self.transport.close()
                return
            self._arm_head_timer()
        else:
            self._head_bytes = 0
            self._disarm_head_timer()

    def on_response_complete(self) -> None:
        self._answered += 1
        self._head_bytes = 0
        super().on_response_complete()  # arms uvicorn's keep-alive timer for silence

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._waiting_for_head():
            return
        if self._head_bytes:
            self.transport.write(_raw_response(
                408, "Request Timeout",
                f"the request's headers did not arrive within {self.header_timeout:g} s",
                "invalid_request_error",
            ))  # fmt: skip
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)


_SPARE_FDS = 512  # descriptors kept for what is not a client's connection


def connection_cap(wanted: int) -> int:
    """`wanted`, or less where the file-descriptor limit cannot hold that many
    connections (the soft limit is raised to the hard one first)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, wanted + _SPARE_FDS)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    cap = max(1, min(wanted, soft - _SPARE_FDS))
    if cap < wanted:
        logger.warning("--max-connections %d lowered to %d (file-descriptor limit %d)",
                       wanted, cap, soft)  # fmt: skip
    return cap


def protocol(header_timeout: float, max_connections: int) -> type[GuardedProtocol]:
    """The protocol class for uvicorn's `http=` with these limits."""
    return type(
        "GatewayHTTPProtocol",
        (GuardedProtocol,),
        {"header_timeout": header_timeout, "max_connections": max_connections},
    )
