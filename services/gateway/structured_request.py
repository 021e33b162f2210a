"""A request's structured output, from whichever field asked for one:
OpenAI's `response_format`, vLLM's `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` or `structured_outputs`, or a chat
request's `tool_choice`. At most one may; each is compiled here (cached per
specification), so an invalid one is a 400 naming its field before anything
runs."""

from __future__ import annotations

import json

from basis.structured_output import StructuredOutput
from services.common.errors import InvalidRequest
from services.gateway.protocol import SamplingFields
from services.gateway.tool_calls import ToolFormat

_SCHEMA_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def requested_outputs(req: SamplingFields) -> dict[str, StructuredOutput]:
    """Field name -> the structured output it asks for (none for plain text)."""
    found: dict[str, StructuredOutput] = {}
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found["response_format"] = StructuredOutput.json_object()
    elif fmt is not None and fmt.type == "json_schema":
        spec = fmt.json_schema
        if spec is None or spec.schema_ is None:
            raise InvalidRequest(
                "response_format json_schema needs json_schema.schema", param="response_format"
            )
        if not spec.name or len(spec.name) > 64 or not set(spec.name) <= _SCHEMA_NAME_CHARS:
            raise InvalidRequest(
                "json_schema.name is 1-64 letters, digits, _ or -", param="response_format"
            )
        found["response_format"] = StructuredOutput.json_schema(spec.schema_, bool(spec.strict))
    if req.guided_json is not None:
        found["guided_json"] = _json(req.guided_json, "guided_json")
    if req.guided_regex is not None:
        found["guided_regex"] = StructuredOutput("regex", req.guided_regex)
    if req.guided_choice is not None:
        found["guided_choice"] = _choice(req.guided_choice, "guided_choice")
    if req.guided_grammar is not None:
        found["guided_grammar"] = StructuredOutput("grammar", req.guided_grammar)
    so = req.structured_outputs
    if so is not None:
        given = [
            value
            for value in (
                so.json_ is not None and _json(so.json_, "structured_outputs"),
                so.regex is not None and StructuredOutput("regex", so.regex),
                so.choice is not None and _choice(so.choice, "structured_outputs"),
                so.grammar is not None and StructuredOutput("grammar", so.grammar),
                bool(so.json_object) and StructuredOutput.json_object(),
            )
            if value
        ]
        if len(given) != 1:
            raise InvalidRequest(
                "structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
                param="structured_outputs",
            )
        found["structured_outputs"] = given[0]
    return found


def _json(schema: dict | str, field: str) -> StructuredOutput:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequest(f"{field} is not valid JSON: {exc}", param=field) from exc
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{field} must be a JSON schema object", param=field)
    return StructuredOutput.json_schema(schema, strict=False)


def _choice(options: list[str], field: str) -> StructuredOutput:
    try:
        return StructuredOutput.choice(options)
    except ValueError as exc:
        raise InvalidRequest(f"{field}: {exc}", param=field) from exc


def checked(outputs: dict[str, StructuredOutput]) -> StructuredOutput | None:
    """The one structured output asked for, compiled; a 400 naming the field
    when two fields ask or the specification is invalid."""
    if len(outputs) > 1:
        names = sorted(outputs)
        raise InvalidRequest(
            f"only one of {', '.join(names)} may constrain the output", param=names[1]
        )
    for field, spec in outputs.items():
        try:
            spec.check()
        except ValueError as exc:
            raise InvalidRequest(str(exc), param=field) from exc
        return spec
    return None


def structured_output(req: SamplingFields) -> StructuredOutput | None:
    return checked(requested_outputs(req))


def tool_output(
    fmt: ToolFormat, functions: list[dict], choice: str | dict, parallel: bool
) -> StructuredOutput | None:
    """What `tool_choice` enforces: a call of some function ("required"), of one
    named function, or text with well-formed calls ("auto"); nothing for "none"."""
    if choice == "none":
        return None
    if choice == "auto":
        return fmt.auto(functions)
    if choice == "required":
        return fmt.required(functions, parallel)
    name = choice["function"]["name"]
    chosen = [f for f in functions if f["name"] == name]
    if not chosen:
        raise InvalidRequest(f"tool_choice names {name!r}, which is not a tool", "tool_choice")
    return fmt.required(chosen, parallel=False)
