"""POST /v1/chat/completions: the messages (and tools) through the model's chat
template; response_format, guided_* and tool_choice as one grammar; the
answer's tool calls parsed per model family, whole or as streamed deltas."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI, Request

from basis.structured_output import StructuredOutput
from services.common.errors import InvalidRequest
from services.gateway import openai_format as fmt
from services.gateway.chat_protocol import ChatCompletionRequest
from services.gateway.gateway_core import GatewayCore
from services.gateway.openai_run import serve
from services.gateway.openapi_doc import (
    RUN_ERRORS,
    ChatCompletionResponse,
    answers,
    request_body,
)
from services.gateway.request_io import parse
from services.gateway.structured_request import checked, requested_outputs, tool_output
from services.gateway.tool_calls import ToolFormat

ROUTE = "/v1/chat/completions"


@dataclass(slots=True)
class ChatPlan:
    tools: list[dict] | None  # rendered into the prompt
    tool_format: ToolFormat | None  # parses calls out of the answer (None: all content)
    structured: StructuredOutput | None


def tool_choice_of(req: ChatCompletionRequest) -> str | dict:
    choice = req.tool_choice
    if choice is None:
        return "auto" if req.tools else "none"
    named = (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    )
    if choice not in ("none", "auto", "required") and not named:
        raise InvalidRequest(
            'tool_choice is "none", "auto", "required" or {"type": "function", '
            '"function": {"name": ...}}',
            param="tool_choice",
        )
    if choice != "none" and not req.tools:
        raise InvalidRequest("tool_choice needs tools", param="tool_choice")
    return choice


def plan_chat(req: ChatCompletionRequest, tool_format: ToolFormat | None) -> ChatPlan:
    outputs = requested_outputs(req)
    choice = tool_choice_of(req)
    if choice == "none":  # the model answers in text; it is not shown the tools
        return ChatPlan(None, None, checked(outputs))
    if tool_format is None:
        raise InvalidRequest("this model's chat template does not support tools", "tools")
    functions = [t.function.model_dump(exclude_none=True) for t in req.tools]
    for function in functions:
        params = function.get("parameters")
        if params is not None:
            spec = StructuredOutput.json_schema(params, bool(function.get("strict")))
            outputs_error = _schema_error(spec)
            if outputs_error:
                raise InvalidRequest(f"tool {function['name']!r}: {outputs_error}", param="tools")
    if choice != "auto" and outputs:
        raise InvalidRequest(
            f"tool_choice {choice!r} cannot be combined with {sorted(outputs)[0]}",
            param="tool_choice",
        )
    if choice != "auto" or not outputs:
        outputs["tool_choice"] = tool_output(
            tool_format, functions, choice, req.parallel_tool_calls
        )
    tools = [{"type": "function", "function": f} for f in functions]
    return ChatPlan(tools, tool_format, checked(outputs))


def _schema_error(spec: StructuredOutput) -> str:
    try:
        spec.check()
    except ValueError as exc:
        return str(exc)
    return ""


def add_chat_route(app: FastAPI, core: GatewayCore, auth) -> None:
    @app.post(
        ROUTE,
        openapi_extra=request_body(ChatCompletionRequest),
        responses=answers(ChatCompletionResponse, *RUN_ERRORS, stream=True),
    )
    async def _chat(request: Request):
        tenant = auth.tenant(request.headers.get("authorization"))
        req = await parse(request, ChatCompletionRequest)
        core.check_model(req.model)
        plan = plan_chat(req, core.tool_format)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        messages = [m.template_message() for m in req.messages]
        prompt_ids = await core.chat_prompt(messages, tools=plan.tools)
        prep = core.prepare(
            prompt_ids,
            lambda m: req.sampling_params(m, logprobs, plan.structured),
            req.max_completion_tokens or req.max_tokens,
            tenant,
            req.priority,
            prefix="chatcmpl",
        )
        request_id, tool_format = prep.request_id, plan.tool_format

        def whole(parts, stats):
            return fmt.chat_response(request_id, req.model, parts[0], stats, tool_format)

        def chunk(index: int, delta: dict, finish=None, logprobs=None, stop=None):
            return fmt.chat_chunk(request_id, req.model, index, delta, finish, logprobs, stop)

        # each streamed output's tool-call parser (none: all of the answer is content)
        parsers = {}
        if tool_format is not None and req.stream:
            parsers = {i: tool_format.stream() for i in range(req.n)}

        def chunks(_which: int, ev):
            parser = parsers.get(ev.index)
            if parser is None:
                delta = {"content": ev.text} if ev.text or ev.finish_reason is None else {}
                return [chunk(ev.index, delta, ev.finish_reason, ev.logprobs, ev.stop_reason)]
            deltas = parser.feed(ev.text)
            deltas += parser.finish() if ev.finish_reason else []
            out, logprobs = [], ev.logprobs
            for delta in deltas:
                out.append(chunk(ev.index, delta, logprobs=logprobs))
                logprobs = None
            if ev.finish_reason is not None:
                finish = ev.finish_reason
                if parser.calls and finish == "stop":
                    finish = "tool_calls"
                out.append(chunk(ev.index, {}, finish, logprobs, ev.stop_reason))
            elif logprobs:
                out.append(chunk(ev.index, {}, logprobs=logprobs))
            return out

        opening = [chunk(i, {"role": "assistant", "content": ""}) for i in range(req.n)]
        return await serve(
            core, ROUTE, request, req, tenant, [prep],
            whole=whole, chunks=chunks, chunk_object="chat.completion.chunk", opening=opening,
        )  # fmt: skip
