"""Tool calls in a model's output, per model family: how they are written, how
they are parsed (whole or streamed, as OpenAI's deltas) and the grammar that
enforces them when `tool_choice` asks for a call.

- "hermes" (Qwen, Hermes templates): `<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>` blocks, optionally after some text.
- "llama3_json" (Llama 3.1 JSON tool calling): the whole message is
  `{"name": ..., "parameters": {...}}` (several: one per line).

A family is chosen from the chat template (or named with --tool-call-parser).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from basis.structured_output import JSON_OPTIONS, StructuredOutput

MAX_PARALLEL_CALLS = 4  # calls one grammar-enforced answer may make


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def message(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _call_schema(function: dict, arguments_key: str) -> dict:
    params = function.get("parameters") or {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, arguments_key: params},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


class ToolFormat:
    name = ""
    arguments_key = ""

    def schema(self, functions: list[dict]) -> str:
        """One call of any of `functions`, as the JSON schema of a grammar's %json."""
        schema = {"anyOf": [_call_schema(f, self.arguments_key) for f in functions]}
        # Functions not marked strict may use keywords the grammar cannot enforce.
        options = JSON_OPTIONS | {"lenient": not all(f.get("strict") for f in functions)}
        return json.dumps(schema | {"x-guidance": options})

    def call_from(self, text: str) -> ToolCall | None:
        """A call from its JSON text, or None if it is not one."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        args = value.get(self.arguments_key, value.get("arguments", value.get("parameters", {})))
        if not isinstance(args, dict):
            return None
        return ToolCall(value["name"], json.dumps(args, ensure_ascii=False))

    def required(self, functions: list[dict], parallel: bool) -> StructuredOutput:
        """Output that is one or more calls (one if not `parallel`) of `functions`."""
        raise NotImplementedError

    def auto(self, functions: list[dict]) -> StructuredOutput:
        """Output that is text, or calls whose arguments match their function."""
        raise NotImplementedError

    def stream(self) -> ToolStream:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole message; text that is no well-formed call
        is content."""
        stream = self.stream()
        deltas = stream.feed(text) + stream.finish()
        content = "".join(d.get("content", "") for d in deltas)
        return (content or None), stream.calls


class ToolStream:
    """Turns a choice's text, as it streams, into OpenAI delta dicts: {"content":
    ...} and {"tool_calls": [...]}; `calls` are the calls so far."""

    def __init__(self):
        self.calls: list[ToolCall] = []

    def _call_deltas(self, call: ToolCall) -> list[dict]:
        index = len(self.calls)
        self.calls.append(call)
        head = {"index": index, "id": call.id, "type": "function"}
        return [
            {"tool_calls": [head | {"function": {"name": call.name, "arguments": ""}}]},
            {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]},
        ]

    def feed(self, text: str) -> list[dict]:
        raise NotImplementedError

    def finish(self) -> list[dict]:
        raise NotImplementedError


class HermesFormat(ToolFormat):
    name = "hermes"
    arguments_key = "arguments"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _call_rule(self, functions: list[dict]) -> str:
        return f'call: "{self.OPEN}\\n" %json {self.schema(functions)} "\\n{self.CLOSE}"\n'

    def required(self, functions: list[dict], parallel: bool) -> StructuredOutput:
        more = f'("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        return StructuredOutput("lark", f"start: call {more}\n" + self._call_rule(functions))

    def auto(self, functions: list[dict]) -> StructuredOutput:
        # Free text; once the text writes the opening tag, a valid call must follow.
        lark = (
            "%llguidance {}\n"
            "start: call* TEXT\n"
            f'call_start[lazy]: TEXT "{self.OPEN}"\n'
            f'call: call_start "\\n" %json {self.schema(functions)} "\\n{self.CLOSE}"\n'
            "TEXT: /(.|\\n)*/\n"
        )
        return StructuredOutput("lark", lark)

    def stream(self) -> ToolStream:
        return _HermesStream(self)


class _HermesStream(ToolStream):
    def __init__(self, fmt: HermesFormat):
        super().__init__()
        self.fmt = fmt
        self.buffer = ""
        self.in_call = False

    def feed(self, text: str) -> list[dict]:
        self.buffer += text
        out: list[dict] = []
        while True:
            if self.in_call:
                end = self.buffer.find(self.fmt.CLOSE)
                if end < 0:
                    return out
                body, self.buffer = self.buffer[:end], self.buffer[end + len(self.fmt.CLOSE) :]
                self.in_call = False
                call = self.fmt.call_from(body.strip())
                if call is None:  # not a call after all: it was text
                    out.append({"content": self.fmt.OPEN + body + self.fmt.CLOSE})
                else:
                    out += self._call_deltas(call)
                continue
            start = self.buffer.find(self.fmt.OPEN)
            if start >= 0:
                out += self._content(self.buffer[:start])
                self.buffer = self.buffer[start + len(self.fmt.OPEN) :]
                self.in_call = True
                continue
            keep = _partial_suffix(self.buffer, self.fmt.OPEN)
            if self.calls and not self.buffer[: len(self.buffer) - keep].strip():
                return out  # whitespace between calls: held until text follows
            out += self._content(self.buffer[: len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep :]
            return out

    def _content(self, text: str) -> list[dict]:
        if not text or (self.calls and not text.strip()):
            return []
        return [{"content": text}]

    def finish(self) -> list[dict]:
        rest = (self.fmt.OPEN if self.in_call else "") + self.buffer
        self.buffer, self.in_call = "", False
        return self._content(rest)


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    arguments_key = "parameters"

    def _rules(self, functions: list[dict], parallel: bool) -> str:
        more = f'("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        return f"calls: call {more}\ncall: %json {self.schema(functions)}\n"

    def required(self, functions: list[dict], parallel: bool) -> StructuredOutput:
        return StructuredOutput("lark", "start: calls\n" + self._rules(functions, parallel))

    def auto(self, functions: list[dict]) -> StructuredOutput:
        # A message is calls or text; text may not start with "{" (that starts a call).
        lark = "start: (calls | TEXT)?\nTEXT: /[^{](.|\\n)*/\n" + self._rules(functions, True)
        return StructuredOutput("lark", lark)

    def stream(self) -> ToolStream:
        return _Llama3Stream(self)


class _Llama3Stream(ToolStream):
    def __init__(self, fmt: Llama3JsonFormat):
        super().__init__()
        self.fmt = fmt
        self.buffer = ""
        self.mode = ""  # "" until the first visible character: "json" or "text"

    def feed(self, text: str) -> list[dict]:
        if self.mode == "text":
            return [{"content": text}] if text else []
        self.buffer += text
        if self.mode == "" and self.buffer.strip():
            self.mode = "json" if self.buffer.lstrip().startswith("{") else "text"
            if self.mode == "text":
                text, self.buffer = self.buffer, ""
                return [{"content": text}]
        return []  # a call is parsed whole, at the end

    def finish(self) -> list[dict]:
        text, self.buffer = self.buffer, ""
        if self.mode != "json":
            return [{"content": text}] if text else []
        calls = [self.fmt.call_from(line) for line in _json_objects(text)]
        if not calls or None in calls:
            return [{"content": text}]
        return [d for call in calls for d in self._call_deltas(call)]


def _json_objects(text: str) -> list[str]:
    """The JSON values of `text`, one after another (separated by whitespace or ';')."""
    decoder, out, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return out
        try:
            _, end = decoder.raw_decode(text, at)
        except ValueError:
            return out + [text[at:]]  # not JSON: call_from rejects it
        out.append(text[at:end])
        at = end


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could begin `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


FORMATS = {f.name: f for f in (HermesFormat(), Llama3JsonFormat())}


def format_for(chat_template: str | None, name: str = "") -> ToolFormat | None:
    """The model's tool-call format: the one named, else the chat template's."""
    if name:
        return FORMATS[name]
    template = chat_template or ""
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if "<|start_header_id|>" in template and "tools" in template:
        return FORMATS["llama3_json"]
    return None
