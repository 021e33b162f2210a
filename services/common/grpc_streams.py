"""Reading a server-streamed gRPC call (grpc.aio) without leaking native memory.

grpc.aio frees a read's native buffers only when the read completes in the task
that awaits it. A read cancelled while in flight (the reader's task cancelled: a
client that left, a timeout around `call.read()`, `call.cancel()` under a pending
read) leaks them for good (grpc/grpc#43360): on the gateway that is hundreds of
bytes per client that hangs up mid-stream, and the scattered leftovers keep the
heap from shrinking. So every read here runs in a task of its own that nobody
cancels; a reader that leaves while a read is pending hands it to a closer, which
waits for it (the peer answers within a decode step or two) and only then
cancels the call. A call is always cancelled when its reader leaves early: since
grpcio 1.83 a call that is merely dropped stays in flight until its channel
closes (grpc/grpc#43462).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

# How long a closer waits for a pending read before cancelling under it anyway
# (a peer that sends nothing for this long is stuck; the few bytes are accepted).
CLOSE_WAIT_S = 30.0

_closers: set[asyncio.Task] = set()


class StreamIdle(Exception):
    """The peer sent nothing for `idle_timeout` seconds."""


async def read_stream(call, idle_timeout: float | None = None) -> AsyncIterator:
    """Yields the call's messages until its end. A failed call raises its
    grpc.RpcError; a silent one StreamIdle. However the reader leaves, the call is
    finished or cancelled, and no read is cancelled in flight."""
    read: asyncio.Future | None = None
    ended = False
    try:
        while True:
            read = asyncio.ensure_future(call.read())
            done, _ = await asyncio.wait((read,), timeout=idle_timeout)
            if not done:
                raise StreamIdle(f"nothing for {idle_timeout:.0f} s")
            message = read.result()  # a failed call raises its RpcError here
            read = None
            if message is grpc.aio.EOF:
                ended = True
                return
            yield message
    except grpc.RpcError:
        ended = True
        raise
    finally:
        if not ended:
            close_later(call, read)


def close_later(call, read: asyncio.Future | None) -> None:
    """Cancels `call` now when no read is pending, else once `read` has completed."""
    if read is None or read.done():
        _settle(read)
        call.cancel()
        return
    task = asyncio.get_running_loop().create_task(_close(call, read))
    _closers.add(task)
    task.add_done_callback(_closers.discard)


async def _close(call, read: asyncio.Future) -> None:
    try:
        await asyncio.wait((read,), timeout=CLOSE_WAIT_S)
    finally:
        _settle(read)
        call.cancel()


def _settle(read: asyncio.Future | None) -> None:
    """Marks a finished read's outcome as seen (no 'exception never retrieved')."""
    if read is not None and read.done() and not read.cancelled():
        read.exception()


def pending_closers() -> int:
    """Calls waiting on a read before they are cancelled (for tests and metrics)."""
    return len(_closers)
