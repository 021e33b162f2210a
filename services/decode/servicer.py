"""The decode service's gRPC servicer: decode the request, call the core,
encode its deltas (timing goes to tracing.py)."""

from __future__ import annotations

from proto.yinian.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.convert import finish_to_proto, params_from_proto
from services.common.grpc_streams import answer_at_once
from services.common.telemetry import context_from_grpc
from services.decode.decode_core import DecodeCore, TokenDelta
from services.decode.tracing import GenerateTrace


def delta_to_chunk(request_id: str, delta: TokenDelta) -> worker_pb2.GenerateChunk:
    chunk = worker_pb2.GenerateChunk(
        request_id=request_id,
        index=delta.index,
        token_ids=delta.token_ids,
        finish_reason=finish_to_proto(delta.finish_reason),
        stop_reason=delta.stop_reason,
        prompt_tokens=delta.prompt_tokens,
        cached_tokens=delta.cached_tokens,
        error=delta.error,
    )
    for chosen, logprob, rank, top in delta.logprobs or ():
        chunk.logprobs.append(
            common_pb2.PositionLogprobs(
                chosen=common_pb2.TokenLogprob(token_id=chosen, logprob=logprob, rank=rank),
                top=[common_pb2.TokenLogprob(token_id=t, logprob=lp, rank=r) for t, lp, r in top],
            )
        )
    return chunk


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    def __init__(self, core: DecodeCore):
        self.core = core

    async def Generate(self, request, context):
        await answer_at_once(context)
        params = params_from_proto(request.params)
        trace = GenerateTrace(self.core.worker_id, request, params, context_from_grpc(context))
        finish = None
        deltas = self.core.generate(
            request.request_id,
            list(request.prompt_token_ids),
            params,
            tenant=request.tenant,
            public_tokens=request.public_tokens,
            priority=request.priority,
            resume_token_ids=list(request.resume_token_ids),
            timing=trace.timing,
            prefill_address=request.prefill_address,
        )
        try:
            while True:
                try:
                    delta = await trace.next(deltas)
                except StopAsyncIteration:
                    break
                finish = delta.finish_reason or finish
                chunk = delta_to_chunk(request.request_id, delta)
                if delta.finish_reason is not None:
                    chunk.timings.CopyFrom(trace.stage_timings())
                yield chunk
        finally:
            await deltas.aclose()  # a caller that left aborts the request
            trace.end(finish)

    async def Abort(self, request, context):
        self.core.abort(request.request_id)
        return worker_pb2.AbortResponse(found=True)
