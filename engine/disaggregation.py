"""The engine's side of prefill/decode disaggregation.

Prefill role: a request may carry a `Handoff`; in the step that completes its
prompt, each layer's blocks are handed to the transport right after that
layer is computed (the transfer overlaps the remaining layers), and when the
request finishes its blocks are *held* under a lease until the decode side
releases them or the lease runs out.

Decode role: `reserve` makes the request and allocates blocks for its whole
prompt (reusing the prefix cache, whose blocks need no transfer) without
queueing it; once the blocks are filled from outside, `commit` appends the
first token (sampled by the prefill side) and the request joins the running
batch like any other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.kv_cache_manager import KVCacheManager
from engine.output_processor import RequestState, process_token
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Logprob, Sequence


class Handoff:
    """How one prefill request's KV leaves: `start` when its final prompt step
    begins (with the source blocks), then `send_layer` after every layer."""

    def __init__(self, skip_blocks: int = 0):
        self.skip_blocks = skip_blocks

    def start(self, src_block_ids: list[int]) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def send_layer(self, layer: int, cache_layer) -> None:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass(slots=True)
class Reservation:
    request_id: str
    skip_blocks: int  # leading prompt blocks already here (prefix cache): not transferred
    dst_block_ids: list[int]  # where the remaining prompt blocks must land
    num_cached_tokens: int


@dataclass(slots=True)
class Lease:
    state: RequestState
    expires: float


class Disaggregation:
    """The engine's handoff state: leases of held prefills, reservations of remote
    ones. It changes the scheduler only through the scheduler's own methods."""

    def __init__(self, kv: KVCacheManager, scheduler: Scheduler, kv_caches: list):
        self.kv = kv
        self.scheduler = scheduler
        self.kv_caches = kv_caches
        self.held: dict[str, Lease] = {}
        self.remote: dict[str, RequestState] = {}

    # -- prefill role ----------------------------------------------------------
    def finishing_handoffs(self, seqs: list[Sequence], num_new: list[int]) -> list[Sequence]:
        """Sequences whose prompt this step completes and whose KV must leave."""
        out = []
        for seq, n in zip(seqs, num_new):
            h = seq.handoff
            if h is not None and seq.num_computed_tokens < seq.prompt_len <= (
                seq.num_computed_tokens + n
            ):
                out.append(seq)
        return out

    def layer_hook(self, seqs: list[Sequence]):
        caches = self.kv_caches
        for seq in seqs:
            ids = self.kv.block_ids(seq)
            last = -(-seq.prompt_len // self.kv.block_size)
            seq.handoff.start(list(ids[seq.handoff.skip_blocks : last]))

        def hook(layer: int) -> None:
            for seq in seqs:
                seq.handoff.send_layer(layer, caches[layer])

        return hook

    def hold(self, state: RequestState, lease_seconds: float) -> None:
        """Keeps a finished request's blocks (the scheduler has let go of its
        sequences) until `release` or the end of the lease."""
        self.release(state.request_id)  # a retried request's earlier lease
        self.held[state.request_id] = Lease(state, time.monotonic() + lease_seconds)

    def release(self, request_id: str) -> bool:
        lease = self.held.pop(request_id, None)
        if lease is None:
            return False
        for seq in lease.state.seqs:
            self.kv.free(seq)
        return True

    def expire(self) -> list[str]:
        now = time.monotonic()
        gone = [rid for rid, lease in self.held.items() if lease.expires <= now]
        for rid in gone:
            self.release(rid)
        return gone

    # -- decode role -----------------------------------------------------------
    def reserve(self, state: RequestState) -> Reservation | None:
        seq = state.seqs[0]
        cached = self.kv.find_cached_prefix(seq)
        missing = seq.prompt_len - len(cached) * self.kv.block_size
        if not self.kv.allocate_slots(seq, missing, cached):
            return None
        self.remote[state.request_id] = state
        ids = self.kv.block_ids(seq)
        return Reservation(
            state.request_id, len(cached), list(ids[len(cached) :]), seq.num_computed_tokens
        )

    def commit(
        self,
        request_id: str,
        token_id: int,
        logprob: float,
        top: dict[int, Logprob] | None,
        max_model_len: int,
    ) -> RequestState:
        """The reserved blocks are filled: publish them, append the prefill side's
        first token, and hand the sequence to the scheduler (unless that token ends it)."""
        state = self.remote.pop(request_id)
        seq = state.seqs[0]
        seq.num_computed_tokens = seq.prompt_len
        self.kv.commit(seq)
        now = time.monotonic()
        state.metrics.first_scheduled_time = state.metrics.first_scheduled_time or now
        process_token(seq, token_id, logprob, top, max_model_len)
        if seq.is_finished:
            self.kv.free(seq)
        else:
            self.scheduler.resume_prefilled(seq)
        return state

    def cancel(self, request_id: str) -> RequestState | None:
        """Drops a reservation; the request is gone (its caller decides what next)."""
        state = self.remote.pop(request_id, None)
        if state is None:
            return None
        for seq in state.seqs:
            self.kv.free(seq)
            seq.finish(FinishReason.ABORT)
        return state
