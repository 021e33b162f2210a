"""The engine computes what Hugging Face transformers computes, for every
supported architecture: prompt and decode logits within 1e-4 (float32), and
greedy outputs of a mixed batch equal to transformers' generate run on each
prompt alone."""

from __future__ import annotations

import pytest
import torch
from conftest import ALL_MODELS
from hf_oracle import hf_greedy, hf_logits, hf_model

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.kv_cache_manager import CachedPrefix
from engine.sequence import Sequence

PROMPT_LENGTHS = (1, 2, 15, 16, 17, 33, 64, 127, 200, 300)


def random_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy_texts(folder, prompts, max_tokens: int) -> list[str]:
    """What a plain engine on the CPU answers to each prompt, greedy and past EOS: what a
    mesh's streams of the same prompts must equal."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.outputs[0].text for o in LLM(folder, device="cpu").generate(prompts, params)]


def hf_and_llm(folder) -> tuple:
    """transformers' model and the engine (float32, CPU) of one model folder."""
    return hf_model(folder), LLM(folder, dtype="float32", device="cpu")


def engine_logits(engine: LLMEngine, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """Runs the engine's model on the prompt, then `steps` greedy decodes, through the
    paged cache; returns the logits of every row of each forward pass."""
    seq = Sequence("probe", "probe", 0, list(prompt), SamplingParams(), frozenset())
    model = engine.runner.model
    out = []
    new = len(prompt)
    cached: CachedPrefix | None = CachedPrefix()  # admitted with nothing cached
    for _ in range(steps + 1):
        assert engine.kv.allocate_slots(seq, new, cached)
        cached = None
        inputs = engine.runner.prepare([seq], [new], [engine.kv.block_ids(seq)])
        logits = model.compute_logits(engine.runner.forward(inputs))
        out.append(logits)
        seq.num_computed_tokens += new
        seq.append_token(int(logits[-1].argmax()))
        new = 1
    engine.kv.free(seq)
    return out


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
