"""The decode service's core, free of gRPC: runs a request on the engine (its
prompt prefilled here or, in the decode role, by a prefill worker) and streams
its delta outputs. A migrated request resumes after the tokens already
streamed."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine import AsyncLLM
from engine.outputs import RequestOutput
from engine.request import EngineRequest
from services.decode.remote_prefill import HandoffTiming, RemotePrefill
from services.worker.shared_kv import SharedKv


@dataclass(slots=True)
class RequestTiming:
    """Monotonic times of one request's stages, for trace spans."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    second_token: float | None = None  # the first token the decode step itself made
    first_received: float | None = None  # the first token's output reached this loop
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
        request: EngineRequest,
        *,
        resume_token_ids: list[int] | None = None,
        timing: RequestTiming | None = None,
        prefill_address: str = "",
    ) -> AsyncIterator[RequestOutput]:
        """Streams the engine's delta outputs (services/worker/wire.py sends those
        with news: tokens or an end). With `resume_token_ids` (a migrated request)
        the engine continues after them and they are not sent again."""
        resume = list(resume_token_ids or [])
        if resume:
            request = _resumed(request, resume)
        request = self.engine.validate(request)
        if self.shared is not None:  # blocks the shared tier has and this worker lacks
            await self.shared.prefetch(request.prompt_ids, request.namespace, request.public_tokens)
        if prefill_address and self.remote is not None and request.params.n == 1:
            outputs = self.engine.open_stream(request.request_id)
            try:
                handoff = await self.remote.run(request, prefill_address)
            except BaseException:
                self.engine.abort(request.request_id)
                raise
            if timing is not None:
                timing.handoff = handoff
        else:
            outputs = self.engine.stream(request, delta=True)
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
                        request.prompt_ids,
                        tokens,
                        request.namespace,
                        request.public_tokens,
                        out.num_cached_tokens,
                    )
            yield out

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)


def _resumed(request: EngineRequest, resume: list[int]) -> EngineRequest:
    """The request that continues after `resume` (tokens streamed already)."""
    params = request.params
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
    return request.replace(prompt_ids=request.prompt_ids + resume, params=params)


def _record(timing: RequestTiming, out: RequestOutput) -> None:
    m = out.metrics
    if m is None:
        return
    timing.first_scheduled = m.first_scheduled_time
    timing.first_token = m.first_token_time
    timing.finished = m.finished_time
    before = timing.output_tokens
    timing.output_tokens += sum(len(c.token_ids) for c in out.outputs)  # delta outputs
    if before == 0 < timing.output_tokens:
        timing.first_received = time.monotonic()
    if before <= 1 < timing.output_tokens and timing.second_token is None:
        timing.second_token = time.monotonic()
    timing.cached_tokens = out.num_cached_tokens
    timing.prompt_tokens = len(out.prompt_token_ids)
