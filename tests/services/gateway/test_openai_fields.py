"""No silent ignores: every field of the OpenAI chat and completions request
schemas (as the `openai` package's types define them) is either honoured or
rejected with a 400 that names it; unknown fields and routes get OpenAI's
error body."""

from __future__ import annotations

import httpx
import pytest
from openai.types import completion_create_params as completion_types
from openai.types.chat import completion_create_params as chat_types
from openai_mesh import (
    MODEL,
    post,
)

OK, REJECTED = "honoured", "rejected"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
MESSAGES = [{"role": "user", "content": "Hello"}]

STREAM = {"stream": True}
# field -> [(value, what happens, check of a whole 200 answer[, other fields of the body])]
CHAT = {
    "messages": [(MESSAGES, OK, None)],
    "model": [(MODEL, OK, None), ("gpt-x", 404, None)],
    "audio": [({"voice": "alloy", "format": "wav"}, REJECTED, None)],
    "frequency_penalty": [(0.5, OK, None), (3.0, 400, None)],
    "function_call": [("auto", REJECTED, None)],
    "functions": [([{"name": "f"}], REJECTED, None)],
    "logit_bias": [({"300": 100}, OK, lambda r: r["usage"]["completion_tokens"] == 2),
                   ({"x": 1}, REJECTED, None)],
    "logprobs": [(True, OK, lambda r: r["choices"][0]["logprobs"]["content"])],
    "max_completion_tokens": [(1, OK, lambda r: r["usage"]["completion_tokens"] == 1)],
    "max_tokens": [(1, OK, lambda r: r["usage"]["completion_tokens"] == 1)],
    "metadata": [({"team": "search"}, OK, None), ({"k": "v" * 600}, REJECTED, None)],
    "modalities": [(["text"], OK, None), (["text", "audio"], REJECTED, None)],
    "moderation": [({"model": "omni-moderation-latest"}, REJECTED, None)],
    "n": [(2, OK, lambda r: len(r["choices"]) == 2)],
    "parallel_tool_calls": [(False, OK, None)],
    "prediction": [({"type": "content", "content": "x"}, REJECTED, None)],
    "presence_penalty": [(0.5, OK, None)],
    "prompt_cache_key": [("key", REJECTED, None)],
    "prompt_cache_options": [({"ttl": "1h"}, REJECTED, None)],
    "prompt_cache_retention": [("24h", REJECTED, None)],
    "reasoning_effort": [("low", REJECTED, None)],
    "response_format": [({"type": "json_object"}, OK, None), ({"type": "xml"}, REJECTED, None)],
    "safety_identifier": [("user-1", OK, None)],
    "seed": [(7, OK, None)],
    "service_tier": [("auto", OK, None), ("flex", REJECTED, None)],
    "stop": [(["\n"], OK, None)],
    "store": [(False, OK, None), (True, REJECTED, None)],
    "stream": [(False, OK, None), (True, OK, None)],
    "stream_options": [({"include_usage": True, "include_obfuscation": True}, OK, None, STREAM),
                       ({"include_usage": True}, REJECTED, None)],
    "temperature": [(0.0, OK, None), (-1.0, 400, None)],
    "tool_choice": [("none", OK, None), ("required", REJECTED, None)],
    "tools": [([TOOL], OK, None), ([{"type": "custom", "custom": {"name": "c"}}], REJECTED, None)],
    "top_logprobs": [(2, OK, lambda r: len(r["choices"][0]["logprobs"]["content"][0]
                                           ["top_logprobs"]) == 2, {"logprobs": True}),
                     (2, REJECTED, None), (30, REJECTED, None, {"logprobs": True})],
    "top_p": [(0.9, OK, None)],
    "user": [("user-1", OK, None)],
    "verbosity": [("low", REJECTED, None)],
    "web_search_options": [({}, REJECTED, None)],
}  # fmt: skip
COMPLETIONS = {
    "model": [(MODEL, OK, None)],
    "prompt": [("Hello", OK, None), ([[1, 2], [3]], OK, lambda r: len(r["choices"]) == 2)],
    "best_of": [(1, OK, None), (3, REJECTED, None)],
    "echo": [(True, OK, lambda r: r["choices"][0]["text"].startswith("Hello"))],
    "frequency_penalty": [(0.5, OK, None)],
    "logit_bias": [({"300": -100}, OK, None)],
    "logprobs": [(2, OK, lambda r: r["choices"][0]["logprobs"]["top_logprobs"]),
                 (9, REJECTED, None)],
    "max_tokens": [(1, OK, lambda r: r["usage"]["completion_tokens"] == 1)],
    "n": [(2, OK, lambda r: len(r["choices"]) == 2)],
    "presence_penalty": [(0.5, OK, None)],
    "seed": [(7, OK, None)],
    "stop": [("\n", OK, None)],
    "stream_options": [({"include_usage": True}, OK, None, STREAM),
                       ({"include_usage": True}, REJECTED, None)],
    "suffix": [("end", REJECTED, None)],
    "temperature": [(0.5, OK, None)],
    "top_p": [(0.5, OK, None)],
    "user": [("user-1", OK, None)],
}  # fmt: skip
CASES = [
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES}, CHAT),
    ("/v1/completions", {"model": MODEL, "prompt": "Hello"}, COMPLETIONS),
]


def test_the_tables_cover_the_openai_request_types():
    # A field the openai package adds must be classified here before this passes.
    assert set(CHAT) == set(chat_types.CompletionCreateParamsBase.__annotations__) | {"stream"}
    assert set(COMPLETIONS) == set(completion_types.CompletionCreateParamsBase.__annotations__)


@pytest.mark.parametrize(("path", "base", "table"), CASES, ids=["chat", "completions"])
def test_every_field_is_honoured_or_rejected_by_name(default_mesh, path, base, table):
    for field, cases in table.items():
        for value, expected, check, *extra in cases:
            body = base | {"max_tokens": 2} | (extra[0] if extra else {}) | {field: value}
            resp = post(default_mesh, path, body)
            where = f"{field}={value!r}: {resp.text[:300]}"
            if expected == OK:
                assert resp.status_code == 200, where
                if body.get("stream"):
                    assert resp.text.endswith("data: [DONE]\n\n"), where
                assert check is None or check(resp.json()), where
                continue
            status = 400 if expected == REJECTED else expected
            assert resp.status_code == status, where
            error = resp.json()["error"]
            assert error["code"] == status and error["type"] and error["message"], where
            if status == 400:
                assert error["param"] == field, where


def test_unknown_fields_and_routes_get_openai_errors(default_mesh):
    resp = post(default_mesh, "/v1/chat/completions",
                {"model": MODEL, "messages": MESSAGES, "temprature": 0.5})  # fmt: skip
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "temprature"
    for method, path in [("POST", "/v1/embeddings"), ("POST", "/v1/responses"),
                         ("GET", "/v1/nothing"), ("GET", "/v1/chat/completions")]:  # fmt: skip
        resp = httpx.request(method, f"{default_mesh.url}{path}", json={}, timeout=30)
        assert resp.status_code in (404, 405), (path, resp.text)
        error = resp.json()["error"]
        assert error["code"] == resp.status_code and path in error["message"]


def test_models_tokenize_and_detokenize(default_mesh):
    listed = httpx.get(f"{default_mesh.url}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in listed] == [MODEL] and isinstance(listed[0]["created"], int)
    one = httpx.get(f"{default_mesh.url}/v1/models/{MODEL}", timeout=30).json()
    assert one == listed[0]
    missing = httpx.get(f"{default_mesh.url}/v1/models/gpt-x", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    text = "The assert statement"
    tokens = post(default_mesh, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) > 1
    back = post(default_mesh, "/detokenize", {"tokens": tokens["tokens"]}).json()
    assert back["prompt"] == text
    chat = post(default_mesh, "/tokenize", {"messages": MESSAGES}).json()
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}
    usage = post(default_mesh, "/v1/chat/completions", body).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"]
