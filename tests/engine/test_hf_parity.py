"""The engine computes what Hugging Face transformers computes, for every
supported architecture: prompt and decode logits within 1e-4 (float32), and
greedy outputs of a mixed batch equal to transformers' generate run on each
prompt alone."""

from __future__ import annotations

import pytest
import torch
from conftest import ALL_MODELS
from hf_oracle import hf_greedy, hf_logits, hf_model
from prompts import PROMPT_LENGTHS, engine_logits, random_prompts

from engine import LLM, EngineConfig, LLMEngine, SamplingParams


def hf_and_llm(folder) -> tuple:
    """transformers' model and the engine (float32, CPU) of one model folder."""
    return hf_model(folder), LLM(folder, dtype="float32", device="cpu")


@pytest.mark.parametrize("name", ALL_MODELS)
def test_logits_match_transformers(name, model_dir):
    folder = model_dir(name)
    hf = hf_model(folder)
    engine = LLMEngine(folder, EngineConfig(dtype="float32", device="cpu"))
    for prompt in random_prompts(engine.model_config.vocab_size, (1, 37, 130), seed=3):
        expected = hf_logits(hf, prompt, steps=8)
        got = engine_logits(engine, prompt, steps=8)
        assert len(got) == len(expected) == 9
        for g, e in zip(got, expected):
            assert g.shape == e.shape
            torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_greedy_batch_equals_transformers_alone(name, model_dir):
    folder = model_dir(name)
    hf, llm = hf_and_llm(folder)
    prompts = random_prompts(llm.engine.model_config.vocab_size, PROMPT_LENGTHS, seed=5)
    params = SamplingParams(max_tokens=12, temperature=0)
    outputs = llm.generate(prompts, params)
    eos = llm.engine.model_config.eos_token_ids
    for prompt, out in zip(prompts, outputs):
        expected = hf_greedy(hf, prompt, 12, eos)
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens"
        reason = "stop" if expected and expected[-1] in eos else "length"
        assert out.outputs[0].finish_reason == reason


def test_repetition_penalty_matches_transformers(model_dir):
    """Repetition penalty has the same meaning as transformers' (prompt and output)."""
    folder = model_dir("tiny-qwen3")
    hf, llm = hf_and_llm(folder)
    prompt = random_prompts(512, (40,), seed=9)[0]
    out = llm.generate(
        [prompt],
        SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.7, ignore_eos=True),
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            do_sample=False,
            repetition_penalty=1.7,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert out[0].outputs[0].token_ids == ref[0, 40:].tolist()


def test_logprobs_are_the_models(model_dir):
    """Returned logprobs are log-softmax of the model's logits: top-N and the chosen token."""
    folder = model_dir("tiny-llama")
    hf, llm = hf_and_llm(folder)
    prompt = random_prompts(512, (21,), seed=4)[0]
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True)
    )[0].outputs[0]
    expected = hf_logits(hf, prompt, steps=4)
    assert len(out.logprobs) == 5
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        ref = torch.log_softmax(expected[step][-1], dim=-1)
        top = ref.topk(3)
        assert list(entry)[:3] == top.indices.tolist()
        for tid, lp in entry.items():
            assert abs(lp.logprob - ref[tid].item()) < 1e-4
        assert entry[token].rank == 1  # greedy picks the most likely
