"""One gateway's link to this worker (Decode.Link): many requests over one call.

The gateway sends each request, and a cancel when its client leaves; the chunks
all the link's requests make go back in LinkDown messages, those made in the same
event-loop turn together, so a decode step of 64 streams costs one message and
not 64. A request ends with a LinkEnd after its last chunk: code 0, or the gRPC
status its failure would have had on Generate. The gateway closing its side, or
the call breaking, aborts every request still running; so does the worker
closing its links once it has drained. Each running request counts as an open
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

    async def take(self) -> worker_pb2.LinkDown:
        """Everything waiting, once there is something."""
        await self._ready.wait()
        self._ready.clear()
        down = worker_pb2.LinkDown(chunks=self.chunks, ends=self.ends)
        self.chunks, self.ends = [], []
        return down


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
        reader = asyncio.ensure_future(self._read(ups))
        try:
            while True:
                take = asyncio.ensure_future(self.outbox.take())
                ends = (take, reader, self.closing)
                await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
                if not take.done():  # the gateway closed its side, the call broke, or closing
                    take.cancel()
                    if reader.done():
                        reader.result()
                    return
                yield take.result()
        finally:
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
        task.add_done_callback(lambda _: self.running.pop(rid, None))

    async def _run(self, request: worker_pb2.GenerateRequest, carrier: dict) -> None:
        rid = request.request_id
        with self.hold():
            try:
                chunks = self.chunks_of(request, carrier)
                try:
                    async for chunk in chunks:
                        self.outbox.chunk(chunk)
                finally:
                    await chunks.aclose()  # a cancelled request is aborted
            except asyncio.CancelledError:
                raise  # cancelled by the gateway (its client left) or the link's end
            except Exception as exc:  # noqa: BLE001 - reported in-band, as Generate would
                code = grpc_status_of(exc)
                if code == grpc.StatusCode.INTERNAL:
                    logger.exception("request %s failed on a link", rid, exc_info=exc)
                self.outbox.end(rid, code, str(exc) or type(exc).__name__)
                return
        self.outbox.end(rid)
