"""OpenAI chat request bodies: messages (with tool calls and tool results),
tool definitions and the chat-only fields, checked as protocol.py checks the
rest: every field honoured or rejected with a 400 that names it."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from services.common.errors import InvalidRequest
from services.gateway.protocol import MAX_TOOLS, SamplingFields, StrictBody

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


class FunctionCall(StrictBody):
    name: str
    arguments: str


class ToolCallParam(StrictBody):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictBody):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None  # handed to the chat template
    tool_calls: list[ToolCallParam] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call answered
    refusal: str | None = None
    audio: dict | None = None
    function_call: dict | None = None

    @model_validator(mode="after")
    def _tool_turns_name_their_call(self):
        # as OpenAI: a tool message answers one call, named by its id
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message of role `tool` needs `tool_call_id`")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an `assistant` message may have `tool_calls`")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") not in ("text", "refusal") or not isinstance(
                part.get(part.get("type")), str
            ):
                raise InvalidRequest("only text content parts are supported", param="messages")
            parts.append(part[part["type"]])
        return "".join(parts)

    def template_message(self) -> dict:
        """The message as the chat template reads it (tool arguments as objects)."""
        for name in ("refusal", "audio", "function_call"):
            if getattr(self, name) is not None:
                raise InvalidRequest(f"messages: `{name}` is not supported", param="messages")
        # OpenAI's "developer" is what chat templates know as "system"
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["content"] = self.text() or None
            message["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        return message


def _template_call(call: ToolCallParam) -> dict:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise InvalidRequest(
            "messages: tool call arguments must be a JSON object", param="messages"
        )
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


class FunctionDefinition(StrictBody):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDefinition(StrictBody):
    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    metadata: dict[str, str] | None = None  # recorded on the request's trace
    safety_identifier: str | None = None  # recorded on the request's trace
    store: bool | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    functions: Any = None
    function_call: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    moderation: Any = None

    def check(self) -> None:
        super().check()
        if self.store:
            raise InvalidRequest("completions are not stored; store must be false", "store")
        if self.service_tier not in (None, "auto", "default"):
            raise InvalidRequest("only the default service tier is served", "service_tier")
        if self.modalities is not None and self.modalities != ["text"]:
            raise InvalidRequest("only text output is supported", param="modalities")
        if self.metadata is not None and (
            len(self.metadata) > 16
            or any(len(k) > 64 or len(v) > 512 for k, v in self.metadata.items())
        ):
            raise InvalidRequest(
                "metadata holds at most 16 pairs, keys up to 64 and values up to 512 characters",
                param="metadata",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        for tool in self.tools or ():
            if not _NAME.match(tool.function.name):
                raise InvalidRequest(
                    f"tool names are 1-64 letters, digits, _ or -: {tool.function.name!r}",
                    param="tools",
                )
