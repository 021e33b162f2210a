"""The outcome of a KV handoff as both sides see it: the prefill service
encodes it into the last PrefillChunk, the decode service decodes it."""

from __future__ import annotations

from dataclasses import dataclass

from proto.yinian.v1 import common_pb2, worker_pb2


@dataclass(slots=True)
class PrefillResult:
    first_token_id: int
    first_logprob: float
    top_logprobs: list[tuple[int, float, int]]  # (token id, logprob, rank)
    cached_tokens: int
    prefill_seconds: float
    transfer_seconds: float
    transfer_bytes: int
    num_blocks: int
    lease_id: str


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
        first_logprobs=common_pb2.PositionLogprobs(
            chosen=common_pb2.TokenLogprob(
                token_id=result.first_token_id, logprob=result.first_logprob
            ),
            top=[
                common_pb2.TokenLogprob(token_id=t, logprob=lp, rank=r)
                for t, lp, r in result.top_logprobs
            ],
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
