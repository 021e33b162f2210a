"""Structured outputs and tool calls as a product team meets them: the official
`openai` client against the CPU mesh (real processes), 100 requests each, every
answer parsed and validated against its schema — with n = 3, streamed, and on a
split prefill/decode mesh."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from openai_mesh import (
    MODEL,
    client,
    post,
)

from yinian.default_model import ensure_default_model
from yinian.mesh import Mesh, MeshSpec

REQUESTS = 100
SCHEMA = {
    "type": "object",
    "properties": {
        "statement": {"enum": ["assert", "pass", "return", "yield"]},
        "level": {"enum": ["easy", "hard"]},
        "lines": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 99},
                  "minItems": 1, "maxItems": 3},
        "author": {"type": "object", "properties": {"name": {"type": "string",
                   "pattern": "^[A-Za-z ]{1,12}$"}, "active": {"type": "boolean"}},
                   "required": ["name", "active"], "additionalProperties": False},
    },
    "required": ["statement", "level", "lines", "author"],
    "additionalProperties": False,
}  # fmt: skip
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup_topic",
        "description": "Look a topic up in the Python documentation.",
        "parameters": {
            "type": "object",
            "properties": {"topic": {"type": "string", "pattern": "^[a-z-]{1,20}$"}},
            "required": ["topic"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, LOOKUP)}


def many(fn, count: int = REQUESTS) -> list:
    # the first two alone (whole and streamed): the openai package builds its response
    # types on first use, and threads building them at once can fail in pydantic
    first = [x for i in range(min(2, count)) for x in fn(i)]
    with ThreadPoolExecutor(50) as pool:  # big batches: fewer model steps in all
        return first + [x for batch in pool.map(fn, range(2, count)) for x in batch]


def chat(mesh, i: int, n: int = 1, **kw) -> list[tuple[dict, str]]:
    """(message, finish_reason) of each choice; streamed when i is odd."""
    messages = [{"role": "user", "content": kw.pop("content", f"Tell me about item {i}.")}]
    args = dict(model=MODEL, messages=messages, n=n, max_tokens=kw.pop("max_tokens", 120), **kw)
    c = client(mesh)
    if i % 2 == 0:
        resp = c.chat.completions.create(**args)
        return [(ch.message.model_dump(), ch.finish_reason) for ch in resp.choices]
    out = [({"content": "", "tool_calls": {}}, None) for _ in range(n)]
    for chunk in c.chat.completions.create(stream=True, **args):
        for ch in chunk.choices:
            message, _ = out[ch.index]
            message["content"] += ch.delta.content or ""
            for call in ch.delta.tool_calls or ():
                entry = message["tool_calls"].setdefault(call.index, {"function": {}})
                if call.function.name:
                    entry["function"]["name"] = call.function.name
                args_so_far = entry["function"].get("arguments", "")
                entry["function"]["arguments"] = args_so_far + (call.function.arguments or "")
            if ch.finish_reason:
                out[ch.index] = (message, ch.finish_reason)
    return [(m | {"tool_calls": list(m["tool_calls"].values()) or None}, f) for m, f in out]


def test_json_schema_100_of_100_with_n3_and_streaming(default_mesh):
    fmt = {"type": "json_schema", "json_schema": {"name": "doc", "schema": SCHEMA, "strict": True}}
    answers = many(lambda i: chat(default_mesh, i, n=3, response_format=fmt))
    assert len(answers) == 3 * REQUESTS
    for message, finish in answers:
        jsonschema.validate(json.loads(message["content"]), SCHEMA)
        assert finish == "stop"


def test_json_object_100_of_100(default_mesh):
    topics = ["assert", "pass", "the import statement", "lambda", "for loops"]
    answers = many(
        lambda i: chat(
            default_mesh,
            i,
            content=f"Describe {topics[i % len(topics)]} as JSON.",
            response_format={"type": "json_object"},
            temperature=0.7,
            seed=i,  # unseeded, one draw in many runs wrote a string past 4,000 characters
            max_tokens=1500,  # room for the longest strings the model writes (a few hundred)
        )
    )
    assert all(isinstance(json.loads(m["content"]), dict) for m, _ in answers)


@pytest.fixture(scope="module")
def split_mesh():
    spec = MeshSpec(
        model=str(ensure_default_model()),
        workers=0,
        prefill=1,
        decode=1,
        port=0,
        engine_argv=["--device", "cpu"],
        scheduler_argv=["--disagg-min-tokens", "1"],
    )
    with Mesh(spec) as mesh:
        yield mesh


def test_json_schema_100_of_100_on_a_split_mesh(split_mesh):
    fmt = {"type": "json_schema", "json_schema": {"name": "doc", "schema": SCHEMA}}
    answers = many(lambda i: chat(split_mesh, i, response_format=fmt))
    for message, _ in answers:
        jsonschema.validate(json.loads(message["content"]), SCHEMA)


def _calls(message: dict) -> list[tuple[str, dict]]:
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in
             message["tool_calls"] or ()]  # fmt: skip
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    return calls


def test_tool_choice_required_and_named_100_of_100(default_mesh):
    tools, named = [WEATHER, LOOKUP], {"type": "function", "function": {"name": "get_weather"}}

    def ask(i: int, choice) -> list:
        # up to 4 calls when parallel: room for the longest four
        parallel = i % 4 < 2
        return chat(default_mesh, i, tools=tools, tool_choice=choice, max_tokens=400,
                    parallel_tool_calls=parallel)  # fmt: skip

    required = many(lambda i: ask(i, "required"))
    forced = many(lambda i: ask(i, named))
    for (message, finish), only_weather in [(a, False) for a in required] + [
        (a, True) for a in forced
    ]:
        calls = _calls(message)
        assert calls and finish == "tool_calls" and not message["content"]
        if only_weather:
            assert [name for name, _ in calls] == ["get_weather"]


def test_tool_choice_auto_answers_in_text_or_well_formed_calls(default_mesh):
    questions = ["Look up lambda in the documentation.", "What is the pass statement?"]
    answers = many(
        lambda i: chat(default_mesh, i, content=questions[i % 2], tools=[LOOKUP]), count=20
    )
    kinds = set()
    for message, finish in answers:
        calls = _calls(message)
        assert calls or message["content"]
        assert (finish == "tool_calls") == bool(calls) or finish == "length"
        kinds.add("calls" if calls else "text")
    # the model was trained to call when asked to look something up, else to answer
    assert kinds == {"calls", "text"}


def test_logit_bias_plus_100_makes_greedy_output_that_token(default_mesh):
    token = post(default_mesh, "/tokenize", {"prompt": " module", "add_special_tokens": False})
    token_id = token.json()["tokens"][0]
    piece = post(default_mesh, "/detokenize", {"tokens": [token_id]}).json()["prompt"]
    resp = client(default_mesh).completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logit_bias={str(token_id): 100}
    )
    assert resp.choices[0].text == piece * 5
