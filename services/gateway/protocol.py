"""OpenAI request bodies (with vLLM's extra sampling fields) and their checks.

Everything a client can get wrong is rejected here, before any placement:
wrong types (pydantic), out-of-range sampling values (SamplingParams), a
prompt or max_tokens beyond the context length, unknown models. Every field of
the OpenAI API is honoured or rejected with a 400 that names it (`param`):
a field not declared here is unknown and rejected; the ones in UNSUPPORTED are
accepted only with the value that asks for nothing.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from basis.sampling_params import SamplingParams
from basis.structured_output import StructuredOutput
from services.common.errors import InvalidRequest

# Out of scope: field -> why. Each may be absent or null, nothing else.
UNSUPPORTED = {
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "functions": "`functions` is deprecated: use `tools`",
    "function_call": "`function_call` is deprecated: use `tool_choice`",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "this model does not reason",
    "verbosity": "this model has no verbosity setting",
    "prompt_cache_key": "prefix caching is automatic; cache keys are not supported",
    "prompt_cache_retention": "prefix caching is automatic; retention is not configurable",
    "prompt_cache_options": "prefix caching is automatic; it has no options",
    "moderation": "moderation is not supported",
    "suffix": "suffixes (fill-in-the-middle) are not supported",
}


# Bounds on what one request may ask for, so that no request occupies the mesh or the
# gateway without end; each is in the published schema (/openapi.json).
MAX_N = 128  # OpenAI's
MAX_PROMPTS = 128  # prompts in one completions request
MAX_STOP = 64  # stop strings
MAX_STOP_CHARS = 1024  # characters of one stop string (the stream holds back as many)
MAX_TOKEN_LIST = 1024  # stop_token_ids, logit_bias entries
MAX_TOOLS = 128  # OpenAI's

StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class StrictBody(BaseModel):
    # Unknown fields are errors, never ignored; known ones must have the right type.
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class StreamOptions(StrictBody):
    include_usage: bool = False
    include_obfuscation: bool = False  # random padding on each chunk (length side channel)
    # every chunk also carries the usage so far (with include_usage; vLLM's extension)
    continuous_usage_stats: bool = False


class JsonSchemaFormat(StrictBody):
    name: str
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(StrictBody):
    """vLLM's `structured_outputs` (the newer form of its guided_* fields)."""

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(StrictBody):
    model: str
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_TOKEN_LIST)] | None = None
    user: str | None = None  # recorded on the request's trace
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_TOKEN_LIST)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    # structured outputs: OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def check(self) -> None:
        """What the types cannot say; InvalidRequest naming the field."""
        for name, why in UNSUPPORTED.items():
            if getattr(self, name, None) is not None:
                raise InvalidRequest(f"`{name}` is not supported: {why}", param=name)
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options needs stream: true", param="stream_options")

    def token_bias(self) -> dict[int, float]:
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise InvalidRequest(
                    f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                )
            bias[int(key)] = value
        return bias

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        structured: StructuredOutput | None = None,
    ) -> SamplingParams:
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
                logit_bias=self.token_bias(),
                structured_output=structured,
            )
        except ValueError as exc:  # its message starts with the field's name
            name = str(exc).split(" ", 1)[0]
            raise InvalidRequest(
                str(exc), param=name if name in self.model_fields else None
            ) from exc


class CompletionRequest(SamplingFields):
    prompt: (
        str
        | Annotated[list[str], Field(max_length=MAX_PROMPTS)]
        | list[int]
        | Annotated[list[list[int]], Field(max_length=MAX_PROMPTS)]
    )
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if self.best_of is not None and self.best_of not in (1, self.n):
            raise InvalidRequest(
                "best_of other than n is not supported (it returns n of n)", param="best_of"
            )
        if self.echo and self.logprobs is not None:
            raise InvalidRequest("echo with logprobs is not supported", param="echo")


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


def check_bounds(params: SamplingParams) -> None:
    """The bounds above, for requests that did not come through these bodies (gRPC)."""
    bounds = [("n", params.n, MAX_N), ("stop", len(params.stop), MAX_STOP),
              ("stop_token_ids", len(params.stop_token_ids), MAX_TOKEN_LIST),
              ("logit_bias", len(params.logit_bias), MAX_TOKEN_LIST),
              ("stop", max(map(len, params.stop), default=0), MAX_STOP_CHARS)]  # fmt: skip
    for name, value, most in bounds:
        if value > most:
            raise InvalidRequest(f"{name}: {value} is over the limit of {most}", param=name)


def completion_prompts(prompt) -> list[str | list[int]]:
    """The prompts of a completion request, as text or token ids each."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequest("the prompt is empty")
    if set(map(type, prompt)) <= {int, bool}:  # token ids (bools are refused by the id check)
        return [list(prompt)]
    return list(prompt)


def error_body(
    message: str, err_type: str, code: int | str | None = None, param: str | None = None
) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
