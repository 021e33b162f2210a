"""One gateway's link to this worker (Decode.Link): many requests over one call.

The gateway sends each request, and a cancel when its client leaves; the chunks
all the link's requests make go back in LinkDown messages, those made in the same
event-loop turn together, so a decode step of 64 streams costs one message and
not 64. A request ends with a LinkEnd after its last chunk: code 0, or the gRPC
status its failure would have had on Generate. The gateway closing its side
(no more requests) lets what runs finish, then the call ends; the call breaking
aborts every request still running, and so does the worker closing its links
once it has drained. Each running request counts as an open
call while the worker drains."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from proto.yinian.v1 import worker_pb2
from services.common.errors import grpc_status_of

logger = logging.getLogger(__name__)
# chunks a message at most (one a stream a step; with top-20 logprobs about 400
# bytes each: messages stay far below the gateway's 64 MiB receive limit)
MAX_CHUNKS = 4096

# (the request, its trace context as a carrier) -> its chunks
ChunksOf = Callable[[worker_pb2.GenerateRequest, dict], AsyncIterator[worker_pb2.GenerateChunk]]


class Outbox:
    """Chunks and ends waiting to be sent, in the order they were made."""

    def __init__(self):
        self.chunks: list[worker_pb2.GenerateChunk] = []
        self.ends: list[worker_pb2.LinkEnd] = []
        self._ready = asyncio.Event()

    def chunk(self, chunk: worker_pb2.GenerateChunk) -> None:
        self.chunks.append(chunk)
        self._ready.set()

    def end(self, request_id: str, code: grpc.StatusCode | None = None, message: str = "") -> None:
        value = 0 if code is None else code.value[0]
        self.ends.append(worker_pb2.LinkEnd(request_id=request_id, code=value, message=message))
        self._ready.set()

    def poke(self) -> None:
        """Wakes a take (which may then find nothing)."""
        self._ready.set()

    def empty(self) -> bool:
        return not self.chunks and not self.ends

    async def take(self) -> worker_pb2.LinkDown:
        """What is waiting, once there is something (or a poke): up to MAX_CHUNKS
        chunks, and the ends once no chunk waits (an end goes after its request's
        chunks)."""
        await self._ready.wait()
        chunks, self.chunks = self.chunks[:MAX_CHUNKS], self.chunks[MAX_CHUNKS:]
        ends = []
        if not self.chunks:
            ends, self.ends = self.ends, []
            self._ready.clear()
        return worker_pb2.LinkDown(chunks=chunks, ends=ends)


class Link:
    """Serves one Link call: `async for down in Link(chunks_of, hold).serve(ups)`.
    `hold()` is a context manager that counts a request as an open call."""

    def __init__(self, chunks_of: ChunksOf, hold: Callable[[], contextlib.AbstractContextManager]):
        self.chunks_of, self.hold = chunks_of, hold
        self.outbox = Outbox()
        self.running: dict[str, asyncio.Task] = {}
        self.closing = asyncio.get_running_loop().create_future()

    def close(self) -> None:
        """Ends the call (the worker is stopping): what is running is cancelled."""
        if not self.closing.done():
            self.closing.set_result(None)

    async def serve(self, ups: AsyncIterator[worker_pb2.LinkUp]) -> AsyncIterator:
        """The call's messages down. A gateway that closes its side (no more
        requests) gets what is running to its end first; a broken call or `close()`
        cancels what is running."""
        reader = asyncio.ensure_future(self._read(ups))
        take: asyncio.Future | None = None  # one at a time: a second would share the outbox
        try:
            while True:
                if take is None:
                    take = asyncio.ensure_future(self.outbox.take())
                waits = (take, self.closing) if reader.done() else (take, reader, self.closing)
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if take.done():
                    down, take = take.result(), None
                    if down.chunks or down.ends:
                        yield down
                elif self.closing.done():
                    return
                if reader.done():
                    reader.result()  # a broken call raises here
                    if not self.running and self.outbox.empty():
                        return  # closed for new requests, and every request has ended
        finally:
            if take is not None:
                take.cancel()
            reader.cancel()
            for task in list(self.running.values()):
                task.cancel()
            await asyncio.gather(reader, *self.running.values(), return_exceptions=True)

    async def _read(self, ups: AsyncIterator[worker_pb2.LinkUp]) -> None:
        async for up in ups:
            which = up.WhichOneof("kind")
            if which == "request":
                self._start(up.request, dict(up.trace_context))
            elif which == "cancel":
                task = self.running.get(up.cancel)
                if task is not None:
                    task.cancel()

    def _start(self, request: worker_pb2.GenerateRequest, carrier: dict) -> None:
        rid = request.request_id
        if not rid or rid in self.running:
            why = "a request on a link needs a request_id no running request of the link has"
            self.outbox.end(rid, grpc.StatusCode.INVALID_ARGUMENT, why)
            return
        task = asyncio.get_running_loop().create_task(self._run(request, carrier))
        self.running[rid] = task
        task.add_done_callback(lambda _: self._gone(rid, task))  # also one cancelled unstarted

    def _gone(self, rid: str, task: asyncio.Task) -> None:
        if self.running.get(rid) is task:  # not a later request of the same id
            del self.running[rid]
        self.outbox.poke()  # a closed link may be done now

    async def _run(self, request: worker_pb2.GenerateRequest, carrier: dict) -> None:
        rid = request.request_id
        code, message = None, ""
        try:
            with self.hold():
                chunks = self.chunks_of(request, carrier)
                try:
                    async for chunk in chunks:
                        self.outbox.chunk(chunk)
                finally:
                    await chunks.aclose()  # a cancelled request is aborted
        except asyncio.CancelledError:
            # by the gateway (its client left), the link's end, or from within (a call
            # of its own cancelled): said, so the gateway never waits on it (it drops
            # an end it no longer waits for)
            code, message = grpc.StatusCode.CANCELLED, "the request was cancelled"
            raise
        except Exception as exc:  # noqa: BLE001 - reported in-band, as Generate would
            code, message = grpc_status_of(exc), str(exc) or type(exc).__name__
            if code == grpc.StatusCode.INTERNAL:
                logger.exception("request %s failed on a link", rid, exc_info=exc)
        finally:
            self.outbox.end(rid, code, message)
