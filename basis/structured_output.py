"""What a request's output must match (structured outputs), torch-free.

One `StructuredOutput` travels with the sampling params from the gateway to
every worker. Its `grammar()` is the llguidance grammar the engine compiles
into a token mask per step (engine/grammar.py); `check()` compiles it without
a tokenizer, so the gateway rejects an invalid schema, regex or grammar
before anything runs. llguidance is imported only when a grammar is built.

JSON is generated compactly (", " and ": " between items, no other
whitespace): free whitespace would let a weak model pad the output forever.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache

KINDS = ("json", "regex", "choice", "grammar", "lark")
# Inside a JSON schema: llguidance's options for that schema (also one inside a grammar).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """kind "json": `spec` is a JSON schema; "regex": a regular expression;
    "choice": a JSON list of strings, one of which is the output; "grammar": a
    Lark or GBNF grammar; "lark": llguidance's Lark (tool calls' grammars). With
    `strict`, a JSON schema keyword the engine cannot enforce is an error;
    without, it is left unenforced (OpenAI's strict=false).
    `consumed` are tokens already generated under this constraint (a migrated
    request resumes after them)."""

    kind: str
    spec: str
    strict: bool = True
    consumed: tuple[int, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str) or not self.spec:
            raise ValueError(f"a structured output needs a non-empty {self.kind} specification")

    @classmethod
    def json_schema(cls, schema: dict | str, strict: bool = True) -> StructuredOutput:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json", text, strict)

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json", '{"type": "object"}', strict=True)

    @classmethod
    def choice(cls, options: list[str]) -> StructuredOutput:
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError("a choice needs a list of non-empty strings")
        return cls("choice", json.dumps(options))

    @property
    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar (not the tokens consumed so far)."""
        return (self.kind, self.spec, self.strict)

    def grammar(self) -> str:
        """The llguidance grammar; ValueError when the specification is invalid."""
        grammar, error = _compile(self.kind, self.spec, self.strict)
        if error:
            raise ValueError(f"invalid {self.kind} for structured output: {error}")
        return grammar

    def check(self) -> None:
        self.grammar()

    def after(self, tokens: list[int]) -> StructuredOutput:
        return StructuredOutput(self.kind, self.spec, self.strict, self.consumed + tuple(tokens))


@lru_cache(maxsize=512)
def _compile(kind: str, spec: str, strict: bool) -> tuple[str, str]:
    """(grammar, error message or "") for one specification; cached, so a schema
    sent with every request is compiled once per process."""
    from llguidance import LLMatcher, grammar_from

    try:
        if kind == "json":
            schema = json.loads(spec)
            if not isinstance(schema, dict):
                return "", "a JSON schema must be an object"
            grammar = LLMatcher.grammar_from_json_schema(
                schema, defaults=JSON_OPTIONS, overrides={"lenient": not strict}
            )
        elif kind == "choice":
            options = json.loads(spec)
            if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
                return "", "a choice must be a list of strings"
            grammar = grammar_from("choice", options)
        elif kind == "lark":
            grammar = LLMatcher.grammar_from_lark(spec)
        else:
            grammar = grammar_from("regex" if kind == "regex" else "grammar", spec)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError too
        return "", str(exc)
    error = LLMatcher.validate_grammar(grammar)
    return grammar, error
