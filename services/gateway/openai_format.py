"""OpenAI response and stream-chunk bodies for completions and chat."""

from __future__ import annotations

import secrets
import time

import orjson

from services.gateway.frontend import RunStats, TokenInfo
from services.gateway.gateway_core import ChoiceResult
from services.gateway.tool_calls import ToolFormat


def usage(stats_list: list[RunStats]) -> dict:
    prompt = sum(s.prompt_tokens for s in stats_list)
    completion = sum(s.completion_tokens for s in stats_list)
    cached = sum(s.cached_tokens for s in stats_list)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_logprobs(infos: list[TokenInfo] | None, offset: int = 0) -> dict | None:
    if infos is None:
        return None
    offsets, position = [], offset
    for info in infos:
        offsets.append(position)
        position += len(info.token)
    return {
        "tokens": [i.token for i in infos],
        "token_logprobs": [i.logprob for i in infos],
        "top_logprobs": [dict(i.top) for i in infos],
        "text_offset": offsets,
    }


def chat_logprobs(infos: list[TokenInfo] | None) -> dict | None:
    if infos is None:
        return None

    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            dict(entry(i.token, i.logprob), top_logprobs=[entry(t, lp) for t, lp in i.top])
            for i in infos
        ]
    }


def completion_response(
    request_id: str, model: str, results: list[ChoiceResult], stats: list[RunStats]
) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": r.index,
                "text": r.text,
                "logprobs": completion_logprobs(r.logprobs),
                "finish_reason": r.finish_reason,
                "stop_reason": r.stop_reason,
            }
            for r in results
        ],
        "usage": usage(stats),
    }


def chat_message(result: ChoiceResult, tool_format: ToolFormat | None) -> tuple[dict, str]:
    """The assistant message of a whole answer (its tool calls parsed out when the
    request offered tools) and its finish reason ("tool_calls" when it called)."""
    if tool_format is None:
        return {"role": "assistant", "content": result.text}, result.finish_reason
    content, calls = tool_format.parse(result.text)
    message = {"role": "assistant", "content": content}
    if not calls:
        return message, result.finish_reason
    message["tool_calls"] = [c.message() for c in calls]
    finish = "tool_calls" if result.finish_reason == "stop" else result.finish_reason
    return message, finish


def chat_response(
    request_id: str,
    model: str,
    results: list[ChoiceResult],
    stats: list[RunStats],
    tool_format: ToolFormat | None = None,
) -> dict:
    choices = []
    for r in results:
        message, finish = chat_message(r, tool_format)
        choices.append(
            {
                "index": r.index,
                "message": message,
                "logprobs": chat_logprobs(r.logprobs),
                "finish_reason": finish,
                "stop_reason": r.stop_reason,
            }
        )
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(stats),
    }


def completion_chunk(
    request_id: str,
    model: str,
    index: int,
    text: str,
    finish_reason,
    logprobs: list[TokenInfo] | None,
    stop_reason=None,
    text_offset: int = 0,
) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": index,
                "text": text,
                "logprobs": completion_logprobs(logprobs, text_offset),
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        ],
    }


def chat_chunk(
    request_id: str,
    model: str,
    index: int,
    delta: dict,
    finish_reason,
    logprobs: list[TokenInfo] | None = None,
    stop_reason=None,
) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": chat_logprobs(logprobs),
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        ],
    }


def usage_chunk(request_id: str, model: str, obj: str, stats: list[RunStats]) -> dict:
    return {
        "id": request_id,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage(stats),
    }


def obfuscated(chunk: dict) -> dict:
    """A stream chunk padded with random characters (OpenAI's include_obfuscation),
    so that its length says nothing about the tokens in it."""
    chunk["obfuscation"] = secrets.token_urlsafe(secrets.randbelow(12) + 4)
    return chunk


def sse(payload: dict | str) -> bytes:
    """One server-sent event: the payload's JSON (UTF-8, no ASCII escapes) or the text
    itself. orjson: a tenth of json.dumps's time on a stream chunk, which every streamed
    token pays; keys that are not strings written as strings, as json.dumps writes them;
    a non-finite float becomes null (json.dumps wrote NaN, not JSON)."""
    if isinstance(payload, str):
        return b"data: " + payload.encode() + b"\n\n"
    data = orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS)
    return b"data: " + data + b"\n\n"
