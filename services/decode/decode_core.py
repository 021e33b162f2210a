"""The decode service's core, free of gRPC: runs a request on the engine (its
prompt prefilled here or, in the decode role, by a prefill worker) and turns
the engine's outputs into per-output token deltas. A migrated request resumes
after the tokens already streamed."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine import AsyncLLM, SamplingParams
from engine.outputs import RequestOutput
from services.decode.remote_prefill import HandoffTiming, RemotePrefill
from services.worker.logprobs import Position, position
from services.worker.shared_kv import SharedKv


@dataclass(slots=True)
class TokenDelta:
    index: int
    token_ids: list[int]
    logprobs: list[Position] | None = None
    finish_reason: str | None = None
    stop_reason: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


@dataclass(slots=True)
class RequestTiming:
    """Monotonic times of one request's stages, for trace spans."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    second_token: float | None = None  # the first token the decode step itself made
    output_tokens: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    handoff: HandoffTiming | None = None


class DecodeCore:
    def __init__(
        self,
        engine: AsyncLLM,
        worker_id: str,
        remote: RemotePrefill | None = None,
        shared: SharedKv | None = None,
    ):
        self.engine = engine
        self.worker_id = worker_id
        self.remote = remote  # decode role: KV handoffs from prefill workers
        self.shared = shared  # the shared KV tier, when the mesh has a KV store

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        tenant: str = "",
        public_tokens: int = 0,
        priority: int = 0,
        resume_token_ids: list[int] | None = None,
        timing: RequestTiming | None = None,
        prefill_address: str = "",
    ) -> AsyncIterator[TokenDelta]:
        """Streams each output's new tokens. With `resume_token_ids` (a migrated
        request) the engine continues after them and they are not sent again."""
        resume = list(resume_token_ids or [])
        if resume:
            if params.n != 1:
                raise ValueError("only single-output requests can be resumed")
            if params.max_tokens is not None:
                if len(resume) >= params.max_tokens:
                    raise ValueError("nothing left to generate after the resumed tokens")
                params = params.clone(
                    max_tokens=params.max_tokens - len(resume),
                    min_tokens=max(0, params.min_tokens - len(resume)),
                )
            if params.structured_output is not None:  # its grammar continues after them
                params = params.clone(structured_output=params.structured_output.after(resume))
        full_prompt = prompt_ids + resume
        self.engine.validate(full_prompt, params)
        if self.shared is not None:  # blocks the shared tier has and this worker lacks
            await self.shared.prefetch(full_prompt, tenant, public_tokens)
        if prefill_address and self.remote is not None and params.n == 1:
            outputs = self.engine.open_stream(request_id)
            try:
                handoff = await self.remote.run(
                    request_id,
                    full_prompt,
                    params,
                    prefill_address,
                    tenant=tenant,
                    public_tokens=public_tokens,
                    priority=priority,
                )
            except BaseException:
                self.engine.abort(request_id)
                raise
            if timing is not None:
                timing.handoff = handoff
        else:
            outputs = self.engine.generate(
                full_prompt,
                params,
                request_id,
                priority=priority,
                namespace=tenant,
                public_tokens=public_tokens,
                delta=True,
                validated=True,  # above, before the prefetch
            )
        generated: dict[int, list[int]] = {}
        async for out in outputs:
            if timing is not None:
                _record(timing, out)
            for completion in out.outputs:
                generated.setdefault(completion.index, []).extend(completion.token_ids)
            if out.finished and self.shared is not None and not out.error:
                # now, not after the last delta: a caller may stop reading once it has it
                for tokens in generated.values():
                    self.shared.write_through(
                        full_prompt, tokens, tenant, public_tokens, out.num_cached_tokens
                    )
            for completion in out.outputs:
                if not completion.token_ids and completion.finish_reason is None:
                    continue
                logprobs = None
                if completion.logprobs is not None:
                    logprobs = [
                        position(entry, token, params.logprobs or 0)
                        for entry, token in zip(completion.logprobs, completion.token_ids)
                    ]
                yield TokenDelta(
                    index=completion.index,
                    token_ids=completion.token_ids,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=""
                    if completion.stop_reason is None
                    else str(completion.stop_reason),
                    prompt_tokens=len(prompt_ids),
                    cached_tokens=out.num_cached_tokens,
                    error=out.error or "",
                )

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)


def _record(timing: RequestTiming, out: RequestOutput) -> None:
    m = out.metrics
    if m is None:
        return
    timing.first_scheduled = m.first_scheduled_time
    timing.first_token = m.first_token_time
    timing.finished = m.finished_time
    before = timing.output_tokens
    timing.output_tokens += sum(len(c.token_ids) for c in out.outputs)  # delta outputs
    if before <= 1 < timing.output_tokens and timing.second_token is None:
        timing.second_token = time.monotonic()
    timing.cached_tokens = out.num_cached_tokens
    timing.prompt_tokens = len(out.prompt_token_ids)
