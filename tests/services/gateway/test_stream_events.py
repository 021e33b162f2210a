"""A streamed chunk as the client reads it: one server-sent event whose data is the
chunk's JSON (UTF-8 as is), or the text itself for `[DONE]`."""

from __future__ import annotations

import json
import math

from services.gateway.openai_format import sse


def test_a_chunk_is_one_event_of_its_json():
    chunk = {"id": "cmpl-1", "choices": [{"index": 0, "text": " héllo 世界", "logprobs": None}]}
    event = sse(chunk)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
    assert json.loads(event[6:]) == chunk
    assert "héllo 世界".encode() in event  # UTF-8, not \\u escapes
    assert sse("[DONE]") == b"data: [DONE]\n\n"


def test_keys_and_floats_json_cannot_carry_as_they_are():
    event = json.loads(sse({"top": {7: -0.5}, "bad": -math.inf, "nan": math.nan})[6:])
    assert event == {"top": {"7": -0.5}, "bad": None, "nan": None}
