"""Reading a server-streamed gRPC call (grpc.aio) without leaking native memory.

grpc.aio frees a read's native buffers only when the read completes in the task
that awaits it. A read cancelled while in flight (the reader's task cancelled: a
client that left, a timeout around `call.read()`, `call.cancel()` under a pending
read) leaks them for good (grpc/grpc#43360): on the gateway that was hundreds of
bytes per client that hung up mid-stream, and the scattered leftovers kept the
heap from shrinking. So every read here runs in a task of its own that the
reader never cancels. A reader that leaves mid-stream (the peer has sent, and
sends again within a step) hands its pending read to a closer, which waits for
it and only then cancels the call. One that leaves before the first message
(the peer may be queueing or prefilling for a long time, and the caller may be
about to free what the peer writes into) cancels at once and pays a few
hundred bytes. A call is always cancelled when its reader leaves early: since grpcio
1.83 a call that is merely dropped stays in flight until its channel closes
(grpc/grpc#43462).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

# How long a closer waits for a pending read before cancelling under it anyway
# (a peer that has streamed and then sends nothing for this long is stuck).
CLOSE_WAIT_S = 5.0

_closers: set[asyncio.Task] = set()
_cancelled_in_flight = 0


class StreamIdle(Exception):
    """The peer sent nothing for `idle_timeout` seconds."""


async def read_stream(call, idle_timeout: float | None = None) -> AsyncIterator:
    """Yields the call's messages until its end. A failed call raises its
    grpc.RpcError; a silent one StreamIdle. However the reader leaves, the call is
    finished or cancelled; after the first message no read is cancelled in flight
    unless the peer stays silent for CLOSE_WAIT_S."""
    read: asyncio.Future | None = None
    ended = received = False
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
            received = True
            yield message
    except grpc.RpcError:
        ended = True
        raise
    finally:
        if not ended:
            close_later(call, read, wait=received)


def close_later(call, read: asyncio.Future | None, wait: bool = True) -> None:
    """Cancels `call` now when no read is pending (or `wait` is false), else once
    `read` has completed (at most CLOSE_WAIT_S from now)."""
    if wait and read is not None and not read.done():
        try:
            task = asyncio.get_running_loop().create_task(_close(call, read))
        except RuntimeError:  # a reader finalized without a loop: nothing can wait
            pass
        else:
            _closers.add(task)
            task.add_done_callback(_closers.discard)
            return
    _end(call, read)


async def _close(call, read: asyncio.Future) -> None:
    try:
        await asyncio.wait((read,), timeout=CLOSE_WAIT_S)
    finally:
        _end(call, read)


def _end(call, read: asyncio.Future | None) -> None:
    """Cancels `call`; under `read` (counted) when it is still pending."""
    global _cancelled_in_flight
    if read is None or read.done():
        _settle(read)
    else:
        _cancelled_in_flight += 1
        read.add_done_callback(_settle)  # it ends with the call's CANCELLED error
    call.cancel()


def _settle(read: asyncio.Future | None) -> None:
    """Marks a finished read's outcome as seen (no 'exception never retrieved')."""
    if read is not None and read.done() and not read.cancelled():
        read.exception()


def pending_closers() -> int:
    """Calls waiting on a read before they are cancelled."""
    return len(_closers)


def cancelled_in_flight() -> int:
    """Reads cancelled while pending so far (each may leak a few hundred bytes)."""
    return _cancelled_in_flight


async def answer_at_once(context) -> None:
    """A server-streaming handler's first step: sends the response headers now,
    before its first message. A client that cancels a call whose headers have not
    arrived leaks far more (~15-24 KB a call in grpcio 1.85) than one that cancels
    after them, and a client may leave while this peer queues or prefills."""
    await context.send_initial_metadata(())
