"""The default model speaks: the committed checkpoint is a few MB, Hugging Face
transformers loads it, its perplexity on held-out documentation is at most a
twentieth of its vocabulary, and the engine continues a prompt with words of
its corpus."""

from __future__ import annotations

import json
import math
import re

import torch

from engine import LLM, SamplingParams
from yinian.default_corpus import held_out_text, topics
from yinian.default_model import ensure_default_model


def test_checkpoint_is_small_and_complete():
    folder = ensure_default_model()
    files = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    size = sum(p.stat().st_size for p in folder.iterdir())
    assert size < 8 * 2**20, f"{size / 2**20:.1f} MB"


def test_held_out_perplexity_is_at_most_a_twentieth_of_the_vocabulary():
    from transformers import AutoTokenizer, LlamaForCausalLM

    folder = ensure_default_model()
    report = json.loads((folder / "training.json").read_text())
    text = held_out_text(report["held_out_topics"])
    assert len(text) > 5000  # this interpreter ships those topics
    model = LlamaForCausalLM.from_pretrained(folder).eval()
    ids = AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, 256):
            window = torch.tensor(ids[start : start + 257])[None]
            logits = model(window[:, :-1]).logits[0]
            total += float(
                torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="sum")
            )
            count += window.shape[1] - 1
    perplexity = math.exp(total / count)
    assert perplexity <= model.config.vocab_size / 20, perplexity


def test_the_engine_continues_a_prompt_in_words_of_its_corpus():
    llm = LLM(ensure_default_model(), device="cpu")
    words = set(re.findall(r"[a-z]+", " ".join(topics().values()).lower()))
    prompts = ["Strings are", "Every object has", "Lambda expressions"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0))
    for out in outs:
        said = re.findall(r"[a-z]+", out.outputs[0].text.lower())
        assert len(said) >= 10, out.outputs[0].text
        known = sum(w in words for w in said) / len(said)
        assert known >= 0.7, (known, out.outputs[0].text)  # random weights: about 0
    chat = llm.engine.tokenizer.encode_chat([{"role": "user", "content": "What is lambda?"}])
    answer = llm.generate([chat], SamplingParams(max_tokens=60, temperature=0))[0].outputs[0]
    assert len(re.findall(r"[a-z]+", answer.text.lower())) >= 5, answer.text
