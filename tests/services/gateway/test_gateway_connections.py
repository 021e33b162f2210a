"""An error answer leaves the client's keep-alive connection usable: every OpenAI
client pools connections, so a bad request must not break the valid one after it
on the same connection. (Errors mid-stream: test_stream_endings.py; 401 and 429:
test_tenants.py.)"""

from __future__ import annotations

import httpx
import pytest
from guarded_mesh import MODEL

VALID = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
ERRORS = [
    ("negative max_tokens", "POST", "/v1/completions", {**VALID, "max_tokens": -1}, 400),
    ("unknown model", "POST", "/v1/completions", {**VALID, "model": "gpt-x"}, 404),
    ("n over 128", "POST", "/v1/completions", {**VALID, "n": 129}, 400),
    ("token out of vocabulary", "POST", "/v1/completions", {**VALID, "prompt": [10**6]}, 400),
    ("malformed json", "POST", "/v1/completions", b"{not json", 400),
    ("unknown route", "POST", "/v1/embeddings", {}, 404),
    ("wrong method", "GET", "/v1/completions", None, 405),
    ("bad chat", "POST", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ("body over the limit", "POST", "/v1/completions", b"x" * (20 << 20), 413),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_error_answer_leaves_the_connection_usable(guarded_mesh, stream):
    with httpx.Client(base_url=guarded_mesh.url, timeout=60) as client:
        for name, method, path, body, status in ERRORS:
            if isinstance(body, dict) and "model" in body:
                body = {**body, "stream": stream}
            kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
            resp = client.request(method, path, **kwargs)
            assert resp.status_code == status, (name, resp.text[:200])
            assert resp.json()["error"]["code"] == status, name
            ok = client.post("/v1/completions", json={**VALID, "stream": stream})
            assert ok.status_code == 200, (name, ok.text[:200])


def test_a_client_that_leaves_mid_stream_does_not_disturb_the_next_request(guarded_mesh):
    body = {**VALID, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=guarded_mesh.url, timeout=60) as client:
        for _ in range(3):
            with client.stream("POST", "/v1/completions", json=body) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        break  # leaves with the stream running
            ok = client.post("/v1/completions", json=VALID)
            assert ok.status_code == 200, ok.text
