"""OpenAI request bodies (with vLLM's extra sampling fields) and their checks.

Everything a client can get wrong is rejected here, before any placement:
wrong types (pydantic), out-of-range sampling values (SamplingParams), a
prompt or max_tokens beyond the context length, unknown models.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from basis.sampling_params import SamplingParams
from services.common.errors import InvalidRequest


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class _Sampling(BaseModel):
    # Unknown fields are ignored (as vLLM does); known ones must have the right type.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(
                n=self.n,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                min_p=self.min_p or 0.0,
                repetition_penalty=self.repetition_penalty or 1.0,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                seed=self.seed,
                stop=stop,
                stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
            )
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None)
    echo: bool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int) -> int:
    """The max_tokens to use; an InvalidRequest when the prompt or the request
    does not fit the model's context (vLLM's message)."""
    if prompt_len == 0:
        raise InvalidRequest("the prompt is empty")
    if prompt_len >= max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {prompt_len} tokens, which leaves no room for a completion."
        )
    if max_tokens is None:
        return max_model_len - prompt_len
    if isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1, got {max_tokens}")
    if prompt_len + max_tokens > max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} for the completion). Please reduce the prompt or max_tokens."
        )
    return max_tokens


def completion_prompts(prompt) -> list[str | list[int]]:
    """The prompts of a completion request, as text or token ids each."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequest("the prompt is empty")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def error_body(
    message: str, err_type: str, code: int | str | None = None, param: str | None = None
) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
