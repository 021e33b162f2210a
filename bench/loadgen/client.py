"""One streamed request to an OpenAI-compatible server, timed the way vLLM times it.

Works against /v1/completions and /v1/chat/completions with `stream: true` and
`stream_options.include_usage`. Per request it records TTFT (first chunk with
non-empty content), the gaps between content chunks (ITL), end-to-end latency,
and token counts from the final usage chunk (else one token per content chunk).
A request fails on a non-200 status, an error event, a broken stream, or a
stream that never produced content; the server's error body is kept verbatim.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestInput:
    api_url: str  # full URL, e.g. http://host:8000/v1/completions
    model: str
    prompt: str | list[int]
    prompt_len: int
    output_len: int
    chat: bool = False
    messages: list[dict] | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    api_key: str | None = None
    extra_body: dict | None = None


@dataclass
class RequestResult:
    success: bool = False
    status_code: int | None = None
    error: str = ""  # the server's error body, verbatim, or the client exception
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between content chunks
    latency: float = 0.0  # seconds, request sent to stream finished
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, when reported
    start_time: float = 0.0  # time.perf_counter() when sent
    generated_text: str = ""
    finished: bool = False  # a finish_reason or [DONE] arrived (even with no text)


def build_payload(req: RequestInput) -> dict:
    payload = {
        "model": req.model,
        "max_tokens": req.output_len,
        "temperature": req.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if req.chat:
        payload["messages"] = req.messages or [{"role": "user", "content": req.prompt}]
    else:
        payload["prompt"] = req.prompt  # token ids are sent as a list, like vLLM accepts
    if req.ignore_eos:  # a vLLM extension; left out when off for strict OpenAI servers
        payload["ignore_eos"] = True
    if req.extra_body:
        payload.update(req.extra_body)
    return payload


def _content(choice: dict, chat: bool) -> str:
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(client: httpx.AsyncClient, req: RequestInput) -> RequestResult:
    headers = {"Content-Type": "application/json"}
    if req.api_key:
        headers["Authorization"] = f"Bearer {req.api_key}"
    result = RequestResult(prompt_tokens=req.prompt_len)
    payload = build_payload(req)
    chunks = 0
    finished = done = False
    usage_tokens = None
    text_parts: list[str] = []
    start = result.start_time = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", req.api_url, json=payload, headers=headers) as resp:
            result.status_code = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                result.error = body or f"HTTP {resp.status_code} {resp.reason_phrase}"
                result.latency = time.perf_counter() - start
                return result
            async for line in resp.aiter_lines():
                # SSE: "data: {...}" events; blank lines, ":" comments, "event:" lines skipped.
                if done or not line.startswith("data:"):
                    continue  # after [DONE], read on to the end so the connection is reused
                data = line[5:].strip()
                now = time.perf_counter()
                result.latency = now - start
                if data == "[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                if isinstance(chunk, dict) and chunk.get("error") is not None:
                    result.error = data  # an error event mid-stream, verbatim
                    return result
                for choice in chunk.get("choices") or []:
                    finished = finished or choice.get("finish_reason") is not None
                    content = _content(choice, req.chat)
                    if not content:
                        continue  # role-only or empty chunks do not count as tokens
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
                    text_parts.append(content)
                usage = chunk.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens")
                    result.prompt_tokens = usage.get("prompt_tokens") or result.prompt_tokens
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        result.latency = time.perf_counter() - start
        return result
    result.generated_text = "".join(text_parts)
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    result.finished = done or finished
    if chunks == 0 and result.finished:
        # A complete answer whose tokens decode to no text: nothing to time.
        result.error = (
            f"the stream finished without any text ({result.output_tokens} tokens): "
            "no first token to time"
        )
    elif chunks == 0:
        result.error = "the stream ended without any content: no first token to time"
    elif not (done or finished):
        result.error = "the stream ended before a finish_reason or [DONE]"
    else:
        result.success = True
    return result


async def hang_up_after(client: httpx.AsyncClient, url: str, body: dict, events: int) -> str:
    """A client that reads `events` events of a streamed completion and hangs up:
    "left", "status N" when it was refused, or "ended early" when the stream ended first."""
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            return f"status {resp.status_code}"
        seen = 0
        async for line in resp.aiter_lines():
            if line.startswith("data:"):
                seen += 1
                if seen >= events:
                    return "left"
    return "ended early"


def make_client(timeout_s: float, max_connections: int | None) -> httpx.AsyncClient:
    """One pooled client per run. The pool is sized so that requests never queue
    inside the client, where their wait would count as server latency. An idle
    connection is dropped after 2 s, before a server's keep-alive (5 s in uvicorn and
    the gateway) closes it: one reused just as the server closes it fails the request."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=None,
                          keepalive_expiry=2.0)  # fmt: skip
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits)


async def list_models(base_url: str, api_key: str | None = None) -> list[str]:
    """Model ids from GET /v1/models, for runs that do not name a model."""
    return [m["id"] for m in await model_cards(base_url, api_key)]


async def model_cards(base_url: str, api_key: str | None = None) -> list[dict]:
    """The model cards of GET /v1/models (id, and where a server says it, `root`: the
    model's folder or hub name, as vLLM writes it)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30) as client:
        resp = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers)
        resp.raise_for_status()
        return list(resp.json().get("data", []))
