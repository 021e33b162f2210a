"""The decode service's gRPC servicer: decode the request, call the core,
encode its outputs (services/worker/wire.py; timing goes to tracing.py). A
request comes alone (Generate) or over a gateway's link (Link, link.py)."""

from __future__ import annotations

import contextlib
from contextlib import aclosing

from proto.yinian.v1 import worker_pb2, worker_pb2_grpc
from services.common.convert import finish_from_proto
from services.common.grpc_server import InFlight
from services.common.grpc_streams import answer_at_once
from services.common.telemetry import context_from_grpc, context_from_headers
from services.decode.decode_core import DecodeCore
from services.decode.link import Link
from services.decode.tracing import GenerateTrace
from services.worker.wire import generate_from_proto, output_to_chunks


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    def __init__(self, core: DecodeCore, calls: InFlight | None = None):
        self.core = core
        self.calls = calls  # the server's open calls: a link counts each request
        self.links: set[Link] = set()

    async def Generate(self, request, context):
        await answer_at_once(context)
        async with aclosing(self._chunks(request, context_from_grpc(context))) as chunks:
            async for chunk in chunks:
                yield chunk

    async def Link(self, request_iterator, context):
        hold = self.calls.holding if self.calls is not None else contextlib.nullcontext
        link = Link(self._link_chunks, hold)
        self.links.add(link)
        try:
            async with aclosing(link.serve(request_iterator)) as downs:
                async for down in downs:
                    yield down
        finally:
            self.links.discard(link)

    async def close_links(self) -> None:
        """Ends every gateway's link (the worker drained and is stopping)."""
        for link in list(self.links):
            link.close()

    def _link_chunks(self, request, carrier: dict):
        return self._chunks(request, context_from_headers(carrier))

    async def _chunks(self, request, parent):
        call = generate_from_proto(request)
        trace = GenerateTrace(self.core.worker_id, call, parent)
        prompt_tokens = len(call.request.prompt_ids)
        top_n = call.request.params.logprobs or 0
        finish = None
        outputs = self.core.generate(
            call.request,
            resume_token_ids=call.resume_token_ids,
            timing=trace.timing,
            prefill_address=call.prefill_address,
        )
        try:
            while True:
                try:
                    out = await trace.next(outputs)
                except StopAsyncIteration:
                    break
                for chunk in output_to_chunks(out, request.request_id, prompt_tokens, top_n):
                    if chunk.finish_reason:
                        finish = finish_from_proto(chunk.finish_reason)
                        chunk.timings.CopyFrom(trace.stage_timings())
                    yield chunk
        finally:
            await outputs.aclose()  # a caller that left aborts the request
            trace.end(finish)

    async def Abort(self, request, context):
        self.core.abort(request.request_id)
        return worker_pb2.AbortResponse(found=True)
