import json
import os
import subprocess
import sys

import pytest
from paths import ROOT
from tokenizers import Tokenizer

from engine.tokenizer_builder import write_tokenizer

SPECIALS = {
    "llama3": [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|eot_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
    ],
    "qwen": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
}

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # 12345678\n\n\ttabs\r\nand  double  spaces ",
    "你好，世界。今天天气很好，我们去公园散步吧。",
    "emoji 😀👍🏽🇨🇳 family 👨\u200d👩\u200d👧 done",
    "mixed: Grüße, e\u0301, Ω≈ç√, العربية, русский, 日本語テキスト",
    " leading and trailing spaces  ",
    "",
]

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One 512-token tokenizer per style, shared by the cheap tests."""
    out = {}
    for style in SPECIALS:
        path = tmp_path_factory.mktemp(f"tok_{style}")
        out[style] = (path, write_tokenizer(path, 512, style=style))
    return out


@pytest.fixture(scope="module")
def qwen_large(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok_qwen_large")
    return path, write_tokenizer(path, 151936, style="qwen")


def _auto(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("style", ["llama3", "qwen"])
def test_exact_vocab_size_small(built, style):
    path, _ = built[style]
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == 512
    assert sorted(tok.get_vocab(with_added_tokens=True).values()) == list(range(512))
    assert len(_auto(path)) == 512


def test_minimum_vocab_size(tmp_path):
    write_tokenizer(tmp_path, 300, style="llama3")
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).get_vocab_size() == 300


def test_exact_vocab_size_large_and_merges_valid(qwen_large):
    path, ids = qwen_large
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == 151936
    assert ids == {"bos_token_id": 151933, "eos_token_id": [151935, 151933], "pad_token_id": 151933}

    model = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    vocab = model["vocab"]
    assert len(vocab) == 151936 - 3
    assert sorted(vocab.values()) == list(range(len(vocab)))
    seen = set()
    for left, right in model["merges"]:
        assert left in vocab and right in vocab
        merged = left + right
        assert merged in vocab and merged not in seen
        seen.add(merged)
    assert len(model["merges"]) == len(vocab) - 256


@pytest.mark.parametrize("style", ["llama3", "qwen"])
@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(built, style, text):
    tok = Tokenizer.from_file(str(built[style][0] / "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == text


def test_round_trip_large(qwen_large):
    tok = Tokenizer.from_file(str(qwen_large[0] / "tokenizer.json"))
    for text in TEXTS:
        assert tok.decode(tok.encode(text).ids) == text


@pytest.mark.parametrize("style", ["llama3", "qwen"])
def test_special_tokens_are_top_ids(built, style):
    path, ids = built[style]
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    specials = SPECIALS[style]
    expected = list(range(512 - len(specials), 512))
    assert [tok.token_to_id(t) for t in specials] == expected
    for token, token_id in zip(specials, expected, strict=True):
        assert tok.decode([token_id], skip_special_tokens=False) == token
        assert tok.decode([token_id], skip_special_tokens=True) == ""
        assert tok.encode(token, add_special_tokens=False).ids == [token_id]
    added = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    assert [(a["id"], a["content"], a["special"]) for a in added] == [
        (i, t, True) for i, t in zip(expected, specials, strict=True)
    ]

    if style == "llama3":
        assert ids == {"bos_token_id": 507, "eos_token_id": [508, 509], "pad_token_id": None}
    else:
        assert ids == {"bos_token_id": 509, "eos_token_id": [511, 509], "pad_token_id": 509}


def test_bos_prepended_only_for_llama3(built):
    llama = Tokenizer.from_file(str(built["llama3"][0] / "tokenizer.json"))
    qwen = Tokenizer.from_file(str(built["qwen"][0] / "tokenizer.json"))
    assert llama.encode("hi").ids[0] == built["llama3"][1]["bos_token_id"]
    assert llama.encode("hi", add_special_tokens=False).ids[0] != built["llama3"][1]["bos_token_id"]
    assert qwen.encode("hi").ids == qwen.encode("hi", add_special_tokens=False).ids


@pytest.mark.parametrize("style", ["llama3", "qwen"])
def test_loaders_agree(built, style):
    path, ids = built[style]
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    auto = _auto(path)
    sample = " ".join(TEXTS) + "<|im_start|><|eot_id|>"
    assert auto.encode(sample) == raw.encode(sample).ids
    assert (
        auto.encode(sample, add_special_tokens=False)
        == raw.encode(sample, add_special_tokens=False).ids
    )
    assert auto.decode(auto.encode(sample), skip_special_tokens=False).endswith(sample)
    eos = ids["eos_token_id"]
    assert auto.eos_token_id in eos
    assert auto.pad_token_id == ids["pad_token_id"]
    if style == "llama3":
        assert auto.bos_token_id == ids["bos_token_id"]
    else:
        assert auto.bos_token is None


def test_chat_template_llama3(built):
    rendered = _auto(built["llama3"][0]).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert rendered == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_chat_template_qwen(built):
    auto = _auto(built["qwen"][0])
    rendered = auto.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = auto.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert without == rendered.removesuffix("<|im_start|>assistant\n")


def test_chat_template_renders_with_plain_jinja(built):
    import jinja2

    config = json.loads((built["llama3"][0] / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = jinja2.Environment().from_string(config["chat_template"])
    rendered = template.render(messages=MESSAGES[1:], add_generation_prompt=False)
    assert (
        rendered
        == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
    )


@pytest.mark.parametrize("style", ["llama3", "qwen"])
def test_tokenizer_config(built, style):
    config = json.loads((built[style][0] / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["clean_up_tokenization_spaces"] is False
    assert isinstance(config["model_max_length"], int)
    if style == "llama3":
        assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (
            "<|begin_of_text|>",
            "<|eot_id|>",
            None,
        )
    else:
        assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (
            None,
            "<|im_end|>",
            "<|endoftext|>",
        )


def test_deterministic(tmp_path):
    # 4096 is beyond what the built-in corpus can train, so synthetic merges are covered too.
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert write_tokenizer(a, 4096, "llama3", seed=3) == write_tokenizer(b, 4096, "llama3", seed=3)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()

    write_tokenizer(c, 4096, "llama3", seed=4)
    assert (a / "tokenizer.json").read_bytes() != (c / "tokenizer.json").read_bytes()


def test_deterministic_across_processes(tmp_path):
    write_tokenizer(tmp_path / "here", 2048, "qwen", seed=1)
    code = (
        "from engine.tokenizer_builder import write_tokenizer; "
        f"write_tokenizer({str(tmp_path / 'there')!r}, 2048, 'qwen', seed=1)"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env)
    assert (tmp_path / "here" / "tokenizer.json").read_bytes() == (
        tmp_path / "there" / "tokenizer.json"
    ).read_bytes()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab_size": 512, "style": "gpt2"}, "unknown tokenizer style"),
        ({"vocab_size": 299}, "too small"),
        ({"vocab_size": 0, "style": "qwen"}, "too small"),
        ({"vocab_size": -5}, "too small"),
        ({"vocab_size": 512.0}, "must be an int"),
        ({"vocab_size": True}, "must be an int"),
    ],
)
def test_invalid_arguments(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        write_tokenizer(tmp_path, **kwargs)
    assert not (tmp_path / "tokenizer.json").exists()
