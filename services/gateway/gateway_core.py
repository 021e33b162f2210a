"""What REST and gRPC share: the served model, prompt tokenization, request
preparation with its checks, admission by tenant limits, running a request with
latency metrics, and collecting a whole (non-streamed) result."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from basis.model_config import ModelConfig
from basis.sampling_params import SamplingParams
from basis.tokenizer import Tokenizer
from services.common import metrics
from services.common.errors import InvalidRequest, NotFound
from services.gateway.admission import Admission
from services.gateway.frontend import ChoiceEvent, Frontend, Prepared, RunStats, TokenInfo
from services.gateway.protocol import check_bounds, check_context
from services.gateway.public_prefixes import load_public_prefixes, public_tokens
from services.gateway.tool_calls import format_for

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
_THREAD_CHARS = 1 << 16  # texts this long or longer are tokenized in a thread


@dataclass(slots=True)
class ChoiceResult:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenInfo] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class GatewayCore:
    def __init__(
        self,
        model_name: str,
        model_dir: str,
        frontend: Frontend,
        max_model_len: int | None = None,
        public_prefixes: str | None = None,
        tool_call_parser: str = "",
    ):
        self.model_name = model_name
        self.model_root = str(Path(model_dir).resolve())  # /v1/models' `root`, as vLLM's
        self.model_config = ModelConfig.from_pretrained(model_dir)
        self.tokenizer = Tokenizer.from_pretrained(model_dir)
        self.max_model_len = self.model_config.context_length(max_model_len)
        # the most characters a prompt that fits the context can have (worked out at start:
        # it decodes the whole vocabulary once)
        self.max_prompt_chars = (
            self.max_model_len * self.tokenizer.max_token_bytes if self.tokenizer else 0
        )
        self.frontend = frontend
        self.admission = Admission()  # no tenant limits unless the app sets them
        self.public_prefixes = load_public_prefixes(
            public_prefixes, self.tokenizer, self.model_config.check_token_ids
        )
        template = self.tokenizer.chat_template if self.tokenizer is not None else None
        self.tool_format = format_for(template, tool_call_parser)  # None: no tool calls
        self.created = int(time.time())  # the model's `created` in /v1/models

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise NotFound(f"The model `{name}` does not exist.")

    async def encode(
        self, text: str, add_special_tokens: bool = True, bounded: bool = True
    ) -> list[int]:
        """A text's token ids. A text longer than `max_model_len` tokens could hold is
        refused before tokenizing (unless not `bounded`: /tokenize counts any text the
        body limit lets in); a long one is tokenized in a thread, so the event loop
        keeps serving everyone else meanwhile."""
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer: send token ids")
        if bounded and len(text) > self.max_prompt_chars:
            raise InvalidRequest(
                f"the prompt has {len(text)} characters: {self.max_model_len} tokens (the "
                f"context) hold at most {self.max_prompt_chars} "
                f"({self.tokenizer.max_token_bytes} a token)"
            )
        if len(text) < _THREAD_CHARS:
            return self.tokenizer.encode(text, add_special_tokens)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)

    async def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("the prompt is empty")
            return await self.encode(prompt)
        try:
            self.model_config.check_token_ids(prompt)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        return list(prompt)

    def detokenize(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer")
        try:
            self.model_config.check_token_ids(token_ids)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        return self.tokenizer.decode(token_ids)

    async def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The messages rendered by the chat template (in a thread when they are long)
        and tokenized like `encode` (the template writes the special tokens itself)."""
        return await self.encode(await self.chat_text(messages, tools), add_special_tokens=False)

    async def chat_text(
        self, messages: list[dict], tools: list[dict] | None = None, **options
    ) -> str:
        if not messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise InvalidRequest("this model has no chat template")
        extra = {"tools": tools} if tools else {}
        render = functools.partial(self.tokenizer.apply_chat_template, messages, **extra,
                                   **{"add_generation_prompt": True, **options})  # fmt: skip
        try:
            if sum(len(str(m.get("content") or "")) for m in messages) < _THREAD_CHARS:
                return render()
            return await asyncio.to_thread(render)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc

    def prepare(
        self,
        prompt_ids: list[int],
        make_params,
        max_tokens: int | None,
        tenant: str,
        priority: int = 0,
        prefix: str = "cmpl",
    ) -> Prepared:
        """`make_params(max_tokens)` builds the SamplingParams once max_tokens is known."""
        max_tokens = check_context(len(prompt_ids), max_tokens, self.max_model_len)
        params: SamplingParams = make_params(max_tokens)
        check_bounds(params)
        try:  # every value must fit the wire's types (int64 seeds, int32 ids)
            prep = Prepared(
                f"{prefix}-{uuid.uuid4().hex}",
                prompt_ids,
                params,
                tenant,
                priority,
                public_tokens(prompt_ids, self.public_prefixes),
            )
        except (ValueError, OverflowError, TypeError) as exc:
            raise InvalidRequest(f"a sampling parameter is out of range: {exc}") from None
        if not INT32_MIN <= priority <= INT32_MAX:
            raise InvalidRequest(
                f"priority must be within [{INT32_MIN}, {INT32_MAX}]", param="priority"
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer; this model has none")
        return prep

    async def events(self, prep: Prepared, stats: RunStats) -> AsyncIterator[ChoiceEvent]:
        """Runs the request, recording TTFT, ITL, E2E and token counters."""
        start = time.monotonic()
        last = None
        metrics.GATEWAY_IN_FLIGHT.inc()
        metrics.PROMPT_TOKENS.inc(len(prep.prompt_ids))
        try:
            async for event in self.frontend.run(prep, stats):
                now = time.monotonic()
                if event.token_ids:
                    if last is None:
                        metrics.TTFT.observe(now - start)
                    else:
                        metrics.ITL.observe(now - last)
                    last = now
                yield event
            metrics.E2E.observe(time.monotonic() - start)
            for reason in stats.finish_reasons:
                metrics.REQUESTS.labels(finish_reason=reason).inc()
        except BaseException:
            metrics.REQUESTS.labels(finish_reason="error").inc()
            raise
        finally:
            metrics.GATEWAY_IN_FLIGHT.dec()

    async def collect(self, prep: Prepared, stats: RunStats) -> list[ChoiceResult]:
        results = [
            ChoiceResult(i, logprobs=[] if prep.params.logprobs is not None else None)
            for i in range(prep.params.n)
        ]
        async for event in self.events(prep, stats):
            r = results[event.index]
            r.text += event.text
            r.token_ids += event.token_ids
            if event.logprobs is not None:
                r.logprobs += event.logprobs
            if event.finish_reason is not None:
                r.finish_reason, r.stop_reason = event.finish_reason, event.stop_reason
        return results
