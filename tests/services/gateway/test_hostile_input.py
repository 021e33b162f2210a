"""Hostile bodies get a clear 4xx with OpenAI's error body, never a 5xx, a crash or
unbounded memory, and the mesh keeps serving valid requests throughout: deep
nesting, huge lists, 20 MB bodies, invalid UTF-8, slow-drip clients."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from guarded_mesh import BODY_TIMEOUT, MODEL, gateway_rss

from yinian.mesh_probe import default_tls

VALID = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
DEEP = "[" * 5000 + "]" * 5000
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

HOSTILE = [
    ("prompt nested 5000 deep", "/v1/completions",
     f'{{"model": "{MODEL}", "prompt": {DEEP}}}'.encode(), 400),
    ("schema nested 5000 deep", "/v1/completions",
     f'{{"model": "{MODEL}", "prompt": "hi", "guided_json": {{"a": {DEEP}}}}}'.encode(), 400),
    ("n 100000", "/v1/completions", {**VALID, "n": 100000}, 400),
    ("n 129", "/v1/chat/completions", {**CHAT, "n": 129}, 400),
    ("invalid UTF-8", "/v1/completions",
     b'{"model": "pydoc-llama", "prompt": "\xff\xfe\xc3", "max_tokens": 2}', 400),
    ("lone surrogate", "/v1/completions",
     b'{"model": "pydoc-llama", "prompt": "a\\ud800", "max_tokens": 2}', 400),
    ("lone surrogate in chat", "/v1/chat/completions",
     b'{"model": "pydoc-llama", "messages": [{"role": "user", "content": "\\udfff"}]}', 400),
    ("lone surrogate to /tokenize", "/tokenize", b'{"prompt": "\\ud800"}', 400),
    ("logprobs 100000", "/v1/completions", {**VALID, "logprobs": 100000}, 400),
    ("top_logprobs 100000", "/v1/chat/completions",
     {**CHAT, "logprobs": True, "top_logprobs": 100000}, 400),
    ("100000 stop strings", "/v1/completions", {**VALID, "stop": ["x"] * 100000}, 400),
    ("a 1 MB stop string", "/v1/completions", {**VALID, "stop": "x" * 1_000_000}, 400),
    ("100000 stop token ids", "/v1/completions",
     {**VALID, "stop_token_ids": list(range(100000))}, 400),
    ("100000 logit_bias entries", "/v1/completions",
     {**VALID, "logit_bias": {str(i): 1 for i in range(100000)}}, 400),
    ("10000 prompts", "/v1/completions", {**VALID, "prompt": ["hi"] * 10000}, 400),
    ("1000 tools", "/v1/chat/completions", {**CHAT, "tools": [TOOL] * 1000}, 400),
    ("20 MB body", "/v1/completions", b"x" * (20 << 20), 413),
    ("seed past int64", "/v1/completions", {**VALID, "seed": 10**30}, 400),
    ("streamed, seed 1e300", "/v1/completions", {**VALID, "seed": 1e300, "stream": True}, 400),
    ("priority past int32", "/v1/chat/completions", {**CHAT, "priority": 2**40}, 400),
    ("tool message without tool_call_id", "/v1/chat/completions",
     {**CHAT, "messages": [*CHAT["messages"], {"role": "tool", "content": "42"}]}, 400),
    ("stop token id past int32", "/v1/completions", {**VALID, "stop_token_ids": [2**40]}, 400),
]  # fmt: skip


def post(mesh, path: str, body, **kw) -> httpx.Response:
    kwargs = {"json": body} if isinstance(body, dict) else {"content": body}
    headers = {"Content-Type": "application/json"}
    url = f"{mesh.url}{path}"
    return httpx.post(url, headers=headers, timeout=60, verify=default_tls(), **kwargs, **kw)


@pytest.mark.parametrize(("name", "path", "body", "status"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_body_gets_a_clear_4xx(guarded_mesh, name, path, body, status):
    resp = post(guarded_mesh, path, body)
    assert resp.status_code == status, resp.text[:300]
    error = resp.json()["error"]
    assert error["code"] == status and error["type"] == "invalid_request_error"
    assert error["message"]
    assert post(guarded_mesh, "/v1/completions", VALID).status_code == 200


def test_bodies_over_the_limit_are_refused_without_being_held(guarded_mesh):
    def chunks():  # no Content-Length: the gateway counts as the bytes come
        for _ in range(20):
            yield b"x" * (1 << 20)

    before = gateway_rss(guarded_mesh)
    for _ in range(3):
        assert post(guarded_mesh, "/v1/completions", b"x" * (20 << 20)).status_code == 413
        resp = post(guarded_mesh, "/v1/completions", chunks())
        assert resp.status_code == 413 and resp.json()["error"]["code"] == 413
    grown = gateway_rss(guarded_mesh) - before
    assert grown < 40 << 20, f"the gateway grew {grown >> 20} MiB"  # 60 MB refused
    assert post(guarded_mesh, "/v1/completions", VALID).status_code == 200


def drip(port: int, results: list, i: int, headers_only: bool, started=None) -> None:
    """A client that sends its request a byte at a time, slowly (`started`, a
    barrier, is passed once its first bytes are sent)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 64\r\n\r\n"
        sock.sendall(head if not headers_only else head[:20])
        if started is not None:
            started.wait()
        answer = b""
        sock.settimeout(0.25)
        deadline = time.monotonic() + BODY_TIMEOUT + 3
        while time.monotonic() < deadline and b"\r\n\r\n" not in answer:
            try:
                sock.sendall(b"{" if not headers_only else b"X")
                answer += sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break
        results[i] = answer


def test_slow_drip_clients_do_not_block_others(guarded_mesh):
    port = int(guarded_mesh.url.rsplit(":", 1)[1])
    results: list = [None] * 40
    started = threading.Barrier(41, timeout=30)  # the 40 clients and this test
    threads = [
        threading.Thread(target=drip, args=(port, results, i, i % 2 == 1, started))
        for i in range(40)
    ]
    for t in threads:
        t.start()
    started.wait()  # every client is connected and dripping
    for _ in range(5):  # served as fast as ever while 40 clients drip
        start = time.monotonic()
        assert post(guarded_mesh, "/v1/completions", VALID).status_code == 200
        assert time.monotonic() - start < 2.0
    for t in threads:
        t.join()
    bodies = results[0::2]  # their bodies never complete: 408 once the body timeout passed
    assert all(r and r.startswith(b"HTTP/1.1 408") for r in bodies), bodies[:2]
    heads = results[1::2]  # nor do their headers: 408 once the header timeout passed
    assert all(r and r.startswith(b"HTTP/1.1 408") for r in heads), heads[:2]
    assert post(guarded_mesh, "/v1/completions", VALID).status_code == 200
