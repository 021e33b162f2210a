"""A scripted OpenAI-compatible server for testing the benchmark client (tests only).

Streams a known number of tokens on a known schedule: the first after
`first_token_s`, then one every `interval_s`, each at a fixed offset from the
request's arrival (so delays do not drift). Serves /v1/completions,
/v1/chat/completions and /v1/models, puts usage in a last chunk when asked,
and can fail on purpose:

* mode "http500": HTTP 500 with an OpenAI error body;
* mode "midstream": a few tokens, then an error event, then the stream ends;
* mode "drop": a few tokens, then the connection is cut.

It records every request body, the peak number of requests in flight and the
Authorization headers it saw. Runs uvicorn in a background thread on a free
127.0.0.1 port.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

ERROR_BODY = {
    "error": {
        "message": "scripted failure: the model is on fire",
        "type": "internal_server_error",
        "param": None,
        "code": 500,
    }
}


@dataclass
class Script:
    first_token_s: float = 0.05
    interval_s: float = 0.01
    num_tokens: int | None = None  # None: the request's max_tokens
    mode: str = "ok"  # ok | http500 | midstream | drop
    fail_after: int = 3  # tokens sent before a midstream error or a drop
    usage: bool = True  # honour stream_options.include_usage
    api_key: str | None = None  # when set, other keys get HTTP 401
    count_text: Callable[[str], int] | None = None  # prompt_tokens of a text; default: words


@dataclass
class Stats:
    bodies: list[dict] = field(default_factory=list)
    auth_headers: list[str | None] = field(default_factory=list)
    in_flight: int = 0
    peak_in_flight: int = 0


class _Dropped(Exception):
    pass


class FakeOpenAIServer:
    def __init__(self, **script):
        self.script = Script(**script)
        self.stats = Stats()
        self._lock = threading.Lock()
        self.app = self._build_app()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def configure(self, **script) -> None:
        """Replace the script (fields not given get their defaults) and clear the stats."""
        self.script = Script(**script)
        self.stats = Stats()

    def start(self) -> FakeOpenAIServer:
        config = uvicorn.Config(self.app, log_level="error", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---------------------------------------------------------------- the app

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self._handle(request, chat=True)

        return app

    async def _handle(self, request: Request, chat: bool):
        body = await request.json()
        script = self.script
        auth = request.headers.get("authorization")
        with self._lock:
            self.stats.bodies.append(body)
            self.stats.auth_headers.append(auth)
        if script.api_key and auth != f"Bearer {script.api_key}":
            err = {"error": {"message": "bad api key", "type": "invalid_request_error"}}
            return JSONResponse(err, status_code=401)
        if script.mode == "http500":
            return JSONResponse(ERROR_BODY, status_code=500)
        n = script.num_tokens if script.num_tokens is not None else body.get("max_tokens", 16)
        with self._lock:
            self.stats.in_flight += 1
            self.stats.peak_in_flight = max(self.stats.peak_in_flight, self.stats.in_flight)
        return StreamingResponse(
            self._stream(body, chat, n, script, time.perf_counter()),
            media_type="text/event-stream",
        )

    def _chunk(self, chat: bool, text: str | None, finish: str | None = None) -> str:
        if chat:
            delta = {"content": text} if text is not None else {"role": "assistant", "content": ""}
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        data = {"id": "fake-1", "object": obj, "model": "fake-model", "choices": [choice]}
        return f"data: {json.dumps(data)}\n\n"

    @staticmethod
    def _prompt_tokens(body: dict, chat: bool, script: Script) -> int:
        prompt = body.get("prompt")
        if not chat and isinstance(prompt, list):
            return len(prompt)  # token ids
        if chat:
            prompt = "".join(m.get("content") or "" for m in body.get("messages") or [])
        count = script.count_text or (lambda text: len(text.split()))
        return count(str(prompt))

    async def _stream(self, body: dict, chat: bool, n: int, script: Script, arrived: float):
        try:
            if chat:  # OpenAI opens a chat stream with a role-only delta: not a token
                yield self._chunk(chat, None)
            for i in range(n):
                due = arrived + script.first_token_s + i * script.interval_s
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                if script.mode in ("midstream", "drop") and i == script.fail_after:
                    if script.mode == "drop":
                        raise _Dropped("connection cut on purpose")
                    yield f"data: {json.dumps(ERROR_BODY)}\n\n"
                    return
                yield self._chunk(chat, f" tok{i}")
            yield self._chunk(chat, "", finish="length")
            if script.usage and (body.get("stream_options") or {}).get("include_usage"):
                prompt_tokens = self._prompt_tokens(body, chat, script)
                usage = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": n,
                    "total_tokens": prompt_tokens + n,
                }
                data = {"id": "fake-1", "model": "fake-model", "choices": [], "usage": usage}
                yield f"data: {json.dumps(data)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            with self._lock:
                self.stats.in_flight -= 1
