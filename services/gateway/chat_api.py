"""POST /v1/chat/completions: the messages (and tools) through the model's chat
template; response_format, guided_* and tool_choice as one grammar; the
answer's tool calls parsed per model family, whole or as streamed deltas."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI, Request

from basis.structured_output import StructuredOutput
from services.common.errors import InvalidRequest, http_status_of
from services.gateway import openai_format as fmt
from services.gateway.chat_protocol import ChatCompletionRequest
from services.gateway.frontend import RunStats
from services.gateway.gateway_core import GatewayCore
from services.gateway.openapi_doc import (
    RUN_ERRORS,
    ChatCompletionResponse,
    answers,
    request_body,
)
from services.gateway.protocol import error_body
from services.gateway.request_io import HeldStream, parse, request_span, run_guarded
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
        ticket = await core.admission.admit(tenant, [prep])
        if not req.stream:

            async def whole():
                stats = RunStats()
                with request_span(core, ROUTE, prep, tenant, req):
                    results = await core.collect(prep, stats)
                return fmt.chat_response(
                    prep.request_id, req.model, results, [stats], plan.tool_format
                )

            return await run_guarded(request, whole(), ticket)

        options = req.stream_options
        include_usage = bool(options and options.include_usage)
        obfuscate = bool(options and options.include_obfuscation)

        def sse(index: int, delta: dict, finish=None, logprobs=None, stop_reason=None) -> str:
            chunk = fmt.chat_chunk(
                prep.request_id, req.model, index, delta, finish, logprobs, stop_reason
            )
            return fmt.sse(fmt.obfuscated(chunk) if obfuscate else chunk)

        async def stream():
            stats = RunStats()
            parsers = {}
            if plan.tool_format is not None:
                parsers = {i: plan.tool_format.stream() for i in range(req.n)}
            with request_span(core, ROUTE, prep, tenant, req):
                for i in range(req.n):
                    yield sse(i, {"role": "assistant", "content": ""})
                try:
                    async for ev in core.events(prep, stats):
                        parser = parsers.get(ev.index)
                        if parser is None:
                            text = ev.text or ev.finish_reason is None
                            delta = {"content": ev.text} if text else {}
                            yield sse(
                                ev.index, delta, ev.finish_reason, ev.logprobs, ev.stop_reason
                            )
                            continue
                        deltas = parser.feed(ev.text)
                        deltas += parser.finish() if ev.finish_reason else []
                        logprobs = ev.logprobs
                        for delta in deltas:
                            yield sse(ev.index, delta, logprobs=logprobs)
                            logprobs = None
                        if ev.finish_reason is not None:
                            finish = ev.finish_reason
                            if parser.calls and finish == "stop":
                                finish = "tool_calls"
                            yield sse(ev.index, {}, finish, logprobs, ev.stop_reason)
                        elif logprobs:
                            yield sse(ev.index, {}, logprobs=logprobs)
                    if include_usage:
                        yield fmt.sse(
                            fmt.usage_chunk(
                                prep.request_id, req.model, "chat.completion.chunk", [stats]
                            )
                        )
                except Exception as exc:  # the stream already began: report in-band
                    status, err_type = http_status_of(exc)
                    yield fmt.sse(error_body(str(exc), err_type, status))
            yield fmt.sse("[DONE]")

        return HeldStream(stream(), ticket)
