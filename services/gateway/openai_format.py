"""OpenAI response and stream-chunk bodies for completions and chat."""

from __future__ import annotations

import json
import time

from services.gateway.frontend import RunStats, TokenInfo
from services.gateway.gateway_core import ChoiceResult


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


def chat_response(
    request_id: str, model: str, results: list[ChoiceResult], stats: list[RunStats]
) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": r.index,
                "message": {"role": "assistant", "content": r.text},
                "logprobs": chat_logprobs(r.logprobs),
                "finish_reason": r.finish_reason,
                "stop_reason": r.stop_reason,
            }
            for r in results
        ],
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


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"
