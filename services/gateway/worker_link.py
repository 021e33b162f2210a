"""The gateway's link to one worker (Decode.Link): every request placed there
shares one call. A request goes up with its trace context; the worker's chunks
come down batched (one message a decode step, whatever the number of streams) and
are handed to each request's reader here, so a streamed token costs the gateway
no gRPC read of its own.

A request's reader sees the same things a Generate call gave: its chunks, then
its end, or the mesh error its failure maps to. A link that breaks (the worker
died, restarted or stopped) fails every request on it with WorkerUnavailable; the
next request to that worker opens a new link. A request that is slower than its
timeout, or whose worker stays silent for `idle_timeout` (before its first chunk
or between two), ends in DeadlineExceeded (checked every `tick` seconds). A reader that leaves
early sends a cancel, which aborts the request on the worker."""

from __future__ import annotations

import asyncio
import time
from collections import deque

import grpc

from proto.yinian.v1 import worker_pb2
from services.common.errors import (
    STATUS_BY_VALUE,
    DeadlineExceeded,
    WorkerUnavailable,
    from_grpc_error,
    from_status,
)
from services.common.telemetry import nats_headers

_DONE = object()  # a request's end, finished


class _Request:
    """One request's chunks not yet read, and how it ended (None: still running)."""

    __slots__ = ("chunks", "end", "over_there", "waiter", "last", "deadline", "idle", "started")

    def __init__(self, timeout: float, idle: float):
        self.chunks: deque = deque()
        self.end: object = None  # _DONE or an exception
        self.over_there = False  # the worker ended it (nothing to cancel there)
        self.waiter: asyncio.Future | None = None
        self.last = time.monotonic()
        self.deadline = self.last + timeout
        self.idle = idle
        self.started = False  # a chunk has come

    def push(self, chunk) -> None:
        self.started = True
        self.chunks.append(chunk)
        self.last = time.monotonic()
        self._wake()

    def finish(self, end: object) -> None:
        if self.end is None:
            self.end = end
            self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class WorkerLink:
    """Requests to one worker over one Link call (`stub` a DecodeStub)."""

    def __init__(self, stub, address: str, tick: float = 1.0):
        self.address, self.tick = address, tick
        self.call = stub.Link()
        self.requests: dict[str, _Request] = {}
        self.broken: Exception | None = None
        # one task writes, so no reader's cancellation lands inside a write (that
        # would cancel the whole call)
        self._outgoing: asyncio.Queue = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()
        self._spawn(self._read())
        self._spawn(self._write())
        self._spawn(self._watch())

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def generate(
        self, request: worker_pb2.GenerateRequest, timeout: float, idle_timeout: float
    ):
        """Yields the request's chunks until its end; raises what its failure maps to."""
        if self.broken is not None:
            raise WorkerUnavailable(f"worker {self.address}: {self.broken}")
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request {rid} already runs on worker {self.address}")
        state = _Request(timeout, idle_timeout)
        self.requests[rid] = state
        try:
            self._outgoing.put_nowait(
                worker_pb2.LinkUp(request=request, trace_context=nats_headers())
            )
            loop = asyncio.get_running_loop()
            while True:
                if state.chunks:
                    yield state.chunks.popleft()
                elif state.end is _DONE:
                    return
                elif state.end is not None:
                    raise state.end
                else:
                    state.waiter = loop.create_future()
                    await state.waiter
                    state.waiter = None
        finally:
            if self.requests.get(rid) is state:
                del self.requests[rid]
            if not state.over_there and self.broken is None:  # left early: abort it there
                self._outgoing.put_nowait(worker_pb2.LinkUp(cancel=rid))

    async def _write(self) -> None:
        while True:
            up = await self._outgoing.get()
            try:
                await self.call.write(up)
            except (grpc.RpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
                self._break(WorkerUnavailable(f"worker {self.address}: the link is down ({exc})"))
                return

    async def _read(self) -> None:
        try:
            while True:
                down = await self.call.read()
                if down is grpc.aio.EOF:
                    raise WorkerUnavailable(f"worker {self.address} closed the link")
                self._push(down.chunks)
                for end in down.ends:
                    state = self.requests.get(end.request_id)
                    if state is not None:
                        state.over_there = True
                        code = STATUS_BY_VALUE.get(end.code, grpc.StatusCode.UNKNOWN)
                        state.finish(_DONE if end.code == 0 else from_status(code, end.message))
        except grpc.RpcError as exc:
            self._break(from_grpc_error(exc))
        except WorkerUnavailable as exc:
            self._break(exc)
        except asyncio.CancelledError:
            self._break(WorkerUnavailable(f"the link to worker {self.address} was closed"))
            raise

    def _push(self, chunks) -> None:
        """Hands each chunk to its request, the first chunks of requests first: their
        readers then run first in this loop turn, so a new request's first token is
        not sent after every running stream's next one (whose readers run after,
        each still in its own order)."""
        later = []
        for chunk in chunks:
            state = self.requests.get(chunk.request_id)
            if state is None:
                continue
            if state.started:
                later.append((state, chunk))
            else:
                state.push(chunk)
        for state, chunk in later:
            state.push(chunk)

    def _break(self, error: Exception) -> None:
        if not isinstance(error, WorkerUnavailable):  # a link's failure is its worker's
            error = WorkerUnavailable(f"worker {self.address}: {error}")
        self.broken = error
        for state in self.requests.values():
            state.finish(error)
        self.call.cancel()  # a write that failed leaves nothing to read (no-op if ended)

    async def _watch(self) -> None:
        """Ends requests past their timeout or silent too long, every `tick`."""
        while self.broken is None:
            await asyncio.sleep(self.tick)
            now = time.monotonic()
            for state in list(self.requests.values()):
                if state.end is not None:
                    continue
                if now > state.deadline:
                    state.finish(DeadlineExceeded(f"worker {self.address}: past its timeout"))
                elif now - state.last > state.idle:
                    state.finish(DeadlineExceeded(
                        f"worker {self.address} sent nothing for {state.idle:.0f} s"))  # fmt: skip

    async def close(self) -> None:
        self.call.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
