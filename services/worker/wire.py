"""The workers' messages to and from the engine's types, in one place: a
Generate or Prefill request becomes an EngineRequest (plus what only the
service needs), the engine's delta outputs become GenerateChunks, and a
handoff's order and result cross between the two workers."""

from __future__ import annotations

from dataclasses import dataclass

from engine.outputs import RequestOutput
from engine.request import EngineRequest
from proto.yinian.v1 import common_pb2, worker_pb2
from services.common.convert import finish_to_proto, params_from_proto, params_to_proto
from services.worker.handoff import HandoffOrder, PrefillResult
from services.worker.logprobs import position


@dataclass(slots=True)
class Generate:
    """A Decode.Generate call: the request, and how it is run."""

    request: EngineRequest
    resume_token_ids: list[int]  # already streamed (a migrated request): continue after
    prefill_address: str  # disaggregated: where the prompt's KV is computed ("" here)


def request_from_proto(
    msg: worker_pb2.GenerateRequest | worker_pb2.PrefillRequest,
) -> EngineRequest:
    """The EngineRequest of either message (a ValueError when its parameters are
    not ones the engine takes); validated later, by the engine."""
    return EngineRequest(
        msg.request_id,
        list(msg.prompt_token_ids),
        params_from_proto(msg.params),
        priority=msg.priority,
        namespace=msg.tenant,
        public_tokens=msg.public_tokens,
    )


def generate_from_proto(msg: worker_pb2.GenerateRequest) -> Generate:
    return Generate(request_from_proto(msg), list(msg.resume_token_ids), msg.prefill_address)


def output_to_chunks(
    out: RequestOutput, request_id: str, prompt_tokens: int, top_n: int
) -> list[worker_pb2.GenerateChunk]:
    """One chunk per output of a delta RequestOutput that has news (tokens or its
    end); `prompt_tokens` is the client's prompt (without resumed tokens)."""
    chunks = []
    for completion in out.outputs:
        if not completion.token_ids and completion.finish_reason is None:
            continue
        chunk = worker_pb2.GenerateChunk(
            request_id=request_id,
            index=completion.index,
            token_ids=completion.token_ids,
            finish_reason=finish_to_proto(completion.finish_reason),
            stop_reason="" if completion.stop_reason is None else str(completion.stop_reason),
            prompt_tokens=prompt_tokens,
            cached_tokens=out.num_cached_tokens,
            error=out.error or "",
        )
        for entry, token in zip(completion.logprobs or (), completion.token_ids):
            chunk.logprobs.append(_position(*position(entry, token, top_n)))
        chunks.append(chunk)
    return chunks


def _position(chosen, logprob, rank, top) -> common_pb2.PositionLogprobs:
    return common_pb2.PositionLogprobs(
        chosen=common_pb2.TokenLogprob(token_id=chosen, logprob=logprob, rank=rank),
        top=[common_pb2.TokenLogprob(token_id=t, logprob=lp, rank=r) for t, lp, r in top],
    )


# -- a KV handoff (the decode worker asks, the prefill worker answers) ------------
def prefill_to_proto(request: EngineRequest, order: HandoffOrder) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_ids,
        params=params_to_proto(request.params),
        tenant=request.namespace,
        public_tokens=request.public_tokens,
        priority=request.priority,
        skip_blocks=order.skip_blocks,
        dst_block_ids=order.dst_block_ids,
        transport=order.transport,
        transport_target=order.target,
        lease_seconds=order.lease_seconds,
        decode_worker_id=order.decode_worker_id,
    )


def prefill_from_proto(msg: worker_pb2.PrefillRequest) -> tuple[EngineRequest, HandoffOrder]:
    order = HandoffOrder(
        msg.transport,
        msg.transport_target,
        list(msg.dst_block_ids),
        msg.skip_blocks,
        msg.lease_seconds or 30.0,
        msg.decode_worker_id,
    )
    return request_from_proto(msg), order


def result_to_chunk(result: PrefillResult, layers_sent: int) -> worker_pb2.PrefillChunk:
    return worker_pb2.PrefillChunk(
        layers_sent=layers_sent,
        num_blocks=result.num_blocks,
        bytes=result.transfer_bytes,
        transfer_seconds=result.transfer_seconds,
        done=True,
        lease_id=result.lease_id,
        prefill_seconds=result.prefill_seconds,
        first_token_id=result.first_token_id,
        cached_tokens=result.cached_tokens,
        first_logprobs=_position(
            result.first_token_id, result.first_logprob, 0, result.top_logprobs
        ),
    )


def result_from_chunk(chunk: worker_pb2.PrefillChunk) -> PrefillResult:
    return PrefillResult(
        chunk.first_token_id,
        chunk.first_logprobs.chosen.logprob,
        [(t.token_id, t.logprob, t.rank) for t in chunk.first_logprobs.top],
        chunk.cached_tokens,
        chunk.prefill_seconds,
        chunk.transfer_seconds,
        chunk.bytes,
        chunk.num_blocks,
        chunk.lease_id,
    )
