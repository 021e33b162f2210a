"""Tool-call parsing per model family: whole messages and the same text streamed
in pieces of any size give the same content and calls; text that is no
well-formed call stays content; each family's grammars compile."""

from __future__ import annotations

import json

import pytest

from services.gateway.tool_calls import FORMATS, format_for

FUNCTIONS = [
    {"name": "get_weather", "parameters": {"type": "object",
     "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"name": "now"},
]  # fmt: skip
HERMES = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)
LLAMA = (
    '{"name": "get_weather", "parameters": {"city": "Paris"}}\n{"name": "now", "parameters": {}}'
)
CASES = [
    ("hermes", HERMES, "Let me check. ", [("get_weather", {"city": "Paris"}), ("now", {})]),
    ("hermes", "No <tool_call> here, <tool_call>\n{bad}\n</tool_call> x", None, []),
    ("hermes", "Cut short <tool_call>\n{\"name\": \"now\"", None, []),
    ("llama3_json", LLAMA, None, [("get_weather", {"city": "Paris"}), ("now", {})]),
    ("llama3_json", "Plain words {not json}", None, []),
    ("llama3_json", '{"name": "now", "parameters": {}', None, []),
]  # fmt: skip


def _streamed(fmt, text: str, size: int):
    stream = fmt.stream()
    deltas = []
    for i in range(0, len(text), size):
        deltas += stream.feed(text[i : i + size])
    deltas += stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for call in d.get("tool_calls", ()):
            entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call.get("function", {}).get("name", "")
            entry["arguments"] += call.get("function", {}).get("arguments", "")
    return content or None, [(c["name"], json.loads(c["arguments"])) for c in calls.values()]


@pytest.mark.parametrize(("family", "text", "content", "calls"), CASES)
def test_whole_and_streamed_parse_alike(family, text, content, calls):
    fmt = FORMATS[family]
    whole_content, whole_calls = fmt.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == calls
    expected_content = text if not calls else content
    assert whole_content == expected_content
    for size in (1, 2, 5, 17, len(text)):
        assert _streamed(fmt, text, size) == (expected_content, calls)


def test_each_family_is_found_and_its_grammars_compile():
    assert format_for("... <tool_call> ...") is FORMATS["hermes"]
    assert format_for("<|start_header_id|>{% if tools %}") is FORMATS["llama3_json"]
    assert format_for("{{ messages }}") is None
    assert format_for(None, "hermes") is FORMATS["hermes"]
    for fmt in FORMATS.values():
        for spec in (fmt.required(FUNCTIONS, True), fmt.required(FUNCTIONS[:1], False),
                     fmt.auto(FUNCTIONS)):  # fmt: skip
            spec.check()
