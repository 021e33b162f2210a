"""A request body read as JSON, with the bounds a parser alone does not keep:
strict UTF-8, nesting at most MAX_DEPTH deep (a recursion error is a 400, not a
500), no lone surrogates in strings (no tokenizer can encode them), and integral
numbers as integers (JSON has one number type: `2.0` is 2 where an integer is
asked for). Every problem is an InvalidRequest."""

from __future__ import annotations

import json
import re

from services.common.errors import InvalidRequest

MAX_DEPTH = 64  # nesting of arrays and objects in a body (JSON schemas included)
_SURROGATE = re.compile("[\ud800-\udfff]")  # "\\ud800" in JSON: no character of UTF-8
_SCALARS = {int, float, bool, type(None)}


def decode_json(raw: bytes):
    """The body's JSON: strict UTF-8, nested at most MAX_DEPTH deep, no lone
    surrogates in its strings (a tokenizer cannot encode them), integral numbers
    as integers."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the body is not valid UTF-8: {exc}") from exc
    try:
        body = json.loads(text, parse_float=_number)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise InvalidRequest(f"the body is nested deeper than {MAX_DEPTH} levels") from exc
    check_values(body)
    return body


def _number(literal: str) -> float | int:
    """JSON has one number type: `2.0` is the integer 2 (where an integer is asked for)."""
    value = float(literal)
    return int(value) if value.is_integer() else value


def check_values(body) -> None:
    if isinstance(body, str):
        _check_text(body)
    pending = [(body, 1)] if isinstance(body, (list, dict)) else []
    while pending:
        value, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise InvalidRequest(f"the body is nested deeper than {MAX_DEPTH} levels")
        items = [*value, *value.values()] if isinstance(value, dict) else value
        if set(map(type, items)) <= _SCALARS:  # a list of token ids, say: nothing inside
            continue
        for item in items:
            if isinstance(item, str):
                _check_text(item)
            elif isinstance(item, (list, dict)):
                pending.append((item, depth + 1))


def _check_text(text: str) -> None:
    if _SURROGATE.search(text):
        raise InvalidRequest("the body holds a lone surrogate (\\ud800-\\udfff): not text")
