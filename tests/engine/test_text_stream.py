"""Streaming text is released only as whole UTF-8 characters, and stop strings
never leak into what was streamed."""

from __future__ import annotations

from basis.sampling_params import SamplingParams
from basis.text_stream import TextStream
from basis.tokenizer import Tokenizer


def pieces(tok: Tokenizer, ids, params: SamplingParams):
    stream = TextStream(tok, params)
    shown, out = 0, []
    for n, token in enumerate(ids, 1):
        stop = stream.append(token, n)
        visible = stream.visible(stop is not None)
        out.append(visible[shown:])
        shown = len(visible)
        if stop is not None:
            break
    return out, stream


def test_multibyte_characters_are_never_split(model_dir):
    tok = Tokenizer.from_pretrained(model_dir("tiny-llama"))
    text = "naïve café — 你好，世界 🙂🚀 ok"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2  # many characters span several byte-level tokens
    out, stream = pieces(tok, ids, SamplingParams())
    assert "".join(out) == text == stream.text
    assert all("\ufffd" not in piece for piece in out)


def test_stop_string_is_held_back_and_cut(model_dir):
    tok = Tokenizer.from_pretrained(model_dir("tiny-qwen3"))
    text = "alpha beta STOP gamma"
    ids = tok.encode(text, add_special_tokens=False)
    out, stream = pieces(tok, ids, SamplingParams(stop=["STOP"]))
    assert "".join(out) == "alpha beta "
    assert stream.text == "alpha beta "
    kept, _ = pieces(tok, ids, SamplingParams(stop=["STOP"], include_stop_str_in_output=True))
    assert "".join(kept) == "alpha beta STOP"
