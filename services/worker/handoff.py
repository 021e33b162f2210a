"""A KV handoff as both sides see it: what the decode worker orders of a
prefill worker besides the request itself, and what comes back. Plain data;
services/worker/wire.py puts both on the wire and takes them off."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class HandoffOrder:
    transport: str  # how the blocks travel (a kv_transport name)
    target: bytes  # where to: the receiver's endpoint data
    dst_block_ids: list[int]  # the decode worker's blocks for prompt blocks skip_blocks..
    skip_blocks: int  # leading prompt blocks the decode worker holds already
    lease_seconds: float = 30.0  # how long the prefill side holds its blocks
    decode_worker_id: str = ""


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
