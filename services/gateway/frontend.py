"""The gateway's core: one request from token ids to streamed text.

It asks where to run (the scheduler, or the gateway's own placer:
local_placement.py), streams token ids from that worker, detokenizes each
output incrementally and applies stop strings (the worker sees none: it stops
on tokens, the gateway on text, and cancels the worker when every output has
stopped). A worker that fails before its first token
is replaced by another placement. Every run ends with each output's finish
reason or an exception: a worker stream that closes early is a failed worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from opentelemetry import trace

from basis.block_hash import hash_prompt_blocks
from basis.sampling_params import SamplingParams
from basis.text_stream import TextStream
from proto.yinian.v1 import common_pb2, worker_pb2
from services.common import metrics
from services.common.convert import finish_from_proto, params_to_proto
from services.common.errors import DeadlineExceeded, WorkerUnavailable
from services.common.telemetry import tracer

logger = logging.getLogger(__name__)
_tracer = tracer("yinian.gateway")


@dataclass(slots=True)
class Prepared:
    """A validated request, ready to run."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tenant: str = ""
    priority: int = 0
    public_tokens: int = 0  # leading tokens of an operator's public prefix
    # `params` as every worker gets them (the gateway finds stop strings itself), encoded
    # once: a value that does not fit the wire's types raises here
    wire_params: common_pb2.SamplingParams = field(init=False)

    def __post_init__(self) -> None:
        worker = self.params.clone(stop=[], include_stop_str_in_output=False)
        self.wire_params = params_to_proto(worker)


@dataclass(slots=True)
class TokenInfo:
    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass(slots=True)
class ChoiceEvent:
    index: int
    text: str  # new visible text
    token_ids: list[int]
    logprobs: list[TokenInfo] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass(slots=True)
class RunStats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    worker_id: str = ""
    first_token_time: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    migrations: int = 0
    timings: object | None = None  # the worker's StageTimings, from its last chunk


class _Choice:
    def __init__(self, tokenizer, params: SamplingParams):
        self.stream = TextStream(tokenizer, params)
        self.num_tokens = 0
        self.token_ids: list[int] = []  # every token streamed, for resuming elsewhere
        self.shown = 0
        self.finished = False


class Frontend:
    def __init__(
        self,
        tokenizer,
        placer,
        workers,
        block_size: int = 16,
        request_timeout: float = 600.0,
        idle_timeout: float = 120.0,
        max_placement_attempts: int = 3,
        max_migrations: int = 2,
    ):
        self.tokenizer = tokenizer
        self.placer = placer  # SchedulerClient or LocalPlacement
        self.workers = workers
        self.block_size = block_size
        self.request_timeout = request_timeout
        self.idle_timeout = idle_timeout
        self.max_placement_attempts = max_placement_attempts
        self.max_migrations = max_migrations

    async def run(self, prep: Prepared, stats: RunStats) -> AsyncIterator[ChoiceEvent]:
        """Streams choice events until every output finished; fills `stats`.

        A worker that fails before its first token is replaced. One that fails
        mid-stream is replaced too (a migration, for single-output requests): the
        new worker gets the prompt plus the tokens already streamed and continues
        after them, so the client sees every token once.
        """
        params = prep.params
        stats.prompt_tokens = len(prep.prompt_ids)
        choices = [_Choice(self.tokenizer, params) for _ in range(params.n)]
        block_size = self.placer.hash_block_size(self.block_size)
        hashes = hash_prompt_blocks(prep.prompt_ids, block_size, prep.tenant, prep.public_tokens)
        excluded: list[str] = []
        failures_before_output = 0
        while True:
            with _tracer.start_as_current_span("placement", kind=trace.SpanKind.CLIENT) as span:
                placement = await self.placer.place(
                    prep.request_id, len(prep.prompt_ids), hashes, prep.tenant, excluded,
                    block_size,
                )  # fmt: skip
                span.set_attribute("yinian.worker_id", placement.worker_id)
                span.set_attribute("yinian.matched_blocks", placement.matched_blocks)
                if placement.prefill_worker_id:
                    span.set_attribute("yinian.prefill_worker_id", placement.prefill_worker_id)
            stats.worker_id = placement.worker_id
            request = worker_pb2.GenerateRequest(
                request_id=prep.request_id,
                prompt_token_ids=prep.prompt_ids,
                params=prep.wire_params,
                tenant=prep.tenant,
                public_tokens=prep.public_tokens,
                priority=prep.priority,
                resume_token_ids=choices[0].token_ids if stats.migrations else [],
                prefill_worker_id=placement.prefill_worker_id,
                prefill_address=placement.prefill_address,
            )
            try:
                async for event in self._stream(placement, request, choices, stats):
                    yield event
                return
            except (WorkerUnavailable, DeadlineExceeded) as exc:
                excluded.append(placement.worker_id)
                if not any(c.num_tokens for c in choices):
                    failures_before_output += 1
                    if failures_before_output >= self.max_placement_attempts:
                        raise WorkerUnavailable(
                            f"worker {placement.worker_id} failed: {exc}"
                        ) from exc
                    logger.warning(
                        "worker %s failed before answering (%s); placing again",
                        placement.worker_id,
                        exc,
                    )
                    continue
                done = sum(c.num_tokens for c in choices)
                if prep.params.n != 1 or stats.migrations >= self.max_migrations:
                    raise WorkerUnavailable(
                        f"worker {placement.worker_id} failed after {done} tokens ({exc}); "
                        f"no migration left"
                    ) from exc
                stats.migrations += 1
                metrics.MIGRATIONS.inc()
                logger.warning(
                    "worker %s failed after %d tokens (%s); migrating %s (%d/%d)",
                    placement.worker_id,
                    done,
                    exc,
                    prep.request_id,
                    stats.migrations,
                    self.max_migrations,
                )

    async def _stream(self, placement, request, choices: list[_Choice], stats: RunStats):
        span = _tracer.start_span(
            "worker.stream",
            kind=trace.SpanKind.CLIENT,
            attributes={"yinian.worker_id": placement.worker_id},
        )
        detok_span = None
        chunks = None
        try:
            with trace.use_span(span, end_on_exit=False):
                chunks = self.workers.generate(
                    placement.address, request, self.request_timeout, self.idle_timeout
                )
                async for chunk in chunks:
                    if chunk.error:
                        raise WorkerUnavailable(chunk.error)
                    if detok_span is None and chunk.token_ids:
                        stats.first_token_time = time.monotonic()
                        detok_span = _tracer.start_span(
                            "detokenize", context=trace.set_span_in_context(span)
                        )
                    stats.cached_tokens = max(stats.cached_tokens, chunk.cached_tokens)
                    if chunk.HasField("timings"):
                        stats.timings = chunk.timings
                    event = self._apply(chunk, choices[chunk.index], stats)
                    if event is not None:
                        yield event
                    if all(c.finished for c in choices):
                        return  # leaving the stream cancels the worker's request
            # A stream that closes with outputs unfinished has lost them (a worker
            # that broke its contract, a proxy that cut the call): never a silent end,
            # it is retried or migrated like a dead worker's, or ends in an error.
            raise WorkerUnavailable(
                f"worker {placement.worker_id} ended the stream before the last token"
            )
        finally:
            if chunks is not None:
                await chunks.aclose()  # now, not when it is collected: ends the call
            if detok_span is not None:
                detok_span.set_attribute("gen_ai.usage.output_tokens", stats.completion_tokens)
                detok_span.end()
            span.end()

    def _apply(self, chunk, choice: _Choice, stats: RunStats) -> ChoiceEvent | None:
        if choice.finished:
            return None
        params = choice.stream.params
        new_ids: list[int] = []
        stop_string = None
        for token in chunk.token_ids:
            choice.num_tokens += 1
            choice.token_ids.append(token)
            new_ids.append(token)
            stop_string = choice.stream.append(token, choice.num_tokens)
            if stop_string is not None:
                break
        stats.completion_tokens += len(new_ids)
        metrics.GENERATION_TOKENS.inc(len(new_ids))
        finish = finish_from_proto(chunk.finish_reason)
        stop_reason: str | int | None = chunk.stop_reason or None
        if stop_string is not None:
            finish, stop_reason = "stop", stop_string
        if isinstance(stop_reason, str) and stop_reason.isdigit() and stop_string is None:
            stop_reason = int(stop_reason)
        choice.finished = finish is not None
        visible = choice.stream.visible(choice.finished)
        text, choice.shown = visible[choice.shown :], len(visible)
        logprobs = None
        if params.logprobs is not None:
            logprobs = [self._token_info(p) for p in chunk.logprobs[: len(new_ids)]]
        if finish is not None:
            stats.finish_reasons.append(finish)
        if not text and not new_ids and finish is None:
            return None
        return ChoiceEvent(chunk.index, text, new_ids, logprobs, finish, stop_reason)

    def _token_info(self, position) -> TokenInfo:
        return TokenInfo(
            token=self._token_text(position.chosen.token_id),
            logprob=position.chosen.logprob,
            top=[(self._token_text(t.token_id), t.logprob) for t in position.top],
        )

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
