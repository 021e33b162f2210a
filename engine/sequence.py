"""A sequence is one stream of tokens the scheduler moves through the engine.

A request with n > 1 owns n sequences; the first computes the prompt and the
others fork from it, sharing its full prompt blocks.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from basis.sampling_params import SamplingParams
from basis.text_stream import TextStream


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 for the most likely token
    decoded_token: str | None = None


@dataclass(eq=False)
class Sequence:
    seq_id: str
    request_id: str
    index: int  # which of the request's n outputs
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    namespace: str = ""  # prefix-cache namespace (tenant); equal prefixes share only within one
    public_tokens: int = 0  # leading tokens of an operator's public prefix (shared by all tenants)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    generator: torch.Generator | None = None
    fork_parent: Sequence | None = None  # set while waiting to fork from the first sequence
    num_preemptions: int = 0
    first_token_time: float | None = None
    text_stream: TextStream | None = None  # set by the engine
    handoff: object | None = None  # prefill role: where this sequence's KV goes
    hold_blocks: bool = False  # prefill role: keep its blocks when it finishes (a lease)
    in_flight: bool = False  # pipeline parallel: in a step not read back yet
    grammar: object | None = None  # structured output: its SequenceGrammar (engine/grammar.py)
    # What delta outputs have handed out so far.
    num_emitted_tokens: int = 0
    num_emitted_chars: int = 0
    # Async scheduling: a token sampled on the device but not yet read back. It counts
    # in num_tokens (the next step computes its position); `pending_token` says where
    # the next step finds its id on the device: (that step's sample, row), the sample's
    # `finish().tokens` (its draw queued, if the grammar masks had held it back).
    num_pending: int = 0
    pending_token: tuple[object, int] | None = None
    # Speculative decoding (engine/speculative.py): the tokens guessed to follow, which
    # its next step computes after its last token, and its tokens as an array.
    draft_token_ids: list[int] = field(default_factory=list)
    token_array: object | None = None

    @property
    def text(self) -> str:
        return self.text_stream.text if self.text_stream is not None else ""

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.prompt_len

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most tokens it may generate."""
        return self.prompt_len + (self.params.max_tokens or 0)

    def ends_by_length(self, max_model_len: int) -> bool:
        """Whether its pending token certainly finishes it (max_tokens, context length)."""
        if not self.num_pending:
            return False
        made = self.num_output_tokens + self.num_pending
        limit = self.params.max_tokens
        return (limit is not None and made >= limit) or self.num_tokens >= max_model_len

    def resolve_pending(self) -> None:
        """Its pending token was read back (the caller appends it)."""
        self.num_pending -= 1
        if not self.num_pending:
            self.pending_token = None

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def finish(self, reason: FinishReason, stop_reason=None, error: str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
