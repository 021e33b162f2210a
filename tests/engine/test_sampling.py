"""Sampling: filters, penalties, seeds that ignore batch composition, stop
tokens and strings, max/min tokens, ignore_eos."""

from __future__ import annotations

import pytest
import torch
from prompts import random_prompts

from engine import LLM, SamplingParams
from engine.sampler import Sampler, _apply_penalties, _filtered_probs
from engine.sequence import Sequence


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request, model_dir):
    return LLM(
        model_dir("tiny-qwen3"), dtype="float32", device="cpu", async_scheduling=request.param
    )


def make_seq(params, prompt=(1, 2), outputs=()):
    s = Sequence("s", "s", 0, list(prompt), params, frozenset({3}))
    for t in outputs:
        s.append_token(t)
    return s


def test_filters_keep_exactly_the_allowed_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top_p = _filtered_probs(logits, [SamplingParams(top_p=0.7)])
    assert (top_p[0] > 0).tolist() == [True, True, False, False]
    top_k = _filtered_probs(logits, [SamplingParams(top_k=3)])
    assert (top_k[0] > 0).tolist() == [True, True, True, False]
    min_p = _filtered_probs(logits, [SamplingParams(min_p=0.5)])
    assert (min_p[0] > 0).tolist() == [True, True, False, False]
    assert torch.allclose(min_p.sum(), torch.tensor(1.0))


def test_sampling_follows_the_distribution():
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1])).repeat(4000, 1)
    seqs = [make_seq(SamplingParams(temperature=1.0))] * 4000
    counts = torch.bincount(torch.tensor(sampler(logits, seqs).token_ids), minlength=3)
    assert torch.allclose(counts / 4000, torch.tensor([0.6, 0.3, 0.1]), atol=0.03)


def test_penalties_follow_their_definitions():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    row = torch.tensor([1.0, -1.0, 2.0, 4.0, 0.5])
    _apply_penalties(row, make_seq(params, prompt=(0,), outputs=(2, 2, 3)))
    # token 0: prompt only -> repetition; 1, 4: unseen; 2: twice in output; 3: once
    expected = [0.5, -1.0, 1.0 - 0.5 - 0.5, 2.0 - 0.5 - 0.25, 0.5]
    assert torch.allclose(row, torch.tensor(expected))


def test_seeded_sampling_ignores_batch_composition(llm):
    prompt = random_prompts(512, (30,), seed=31)[0]
    seeded = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=100, seed=1234, max_tokens=20, ignore_eos=True
    )
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    others = random_prompts(512, (3, 50, 17, 120, 8, 64), seed=32)
    mixed_params = [SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=0.7, seed=9, max_tokens=15, ignore_eos=True)
    ] * 3
    outs = llm.generate(
        others[:3] + [prompt] + others[3:], mixed_params[:3] + [seeded] + mixed_params[3:]
    )
    assert outs[3].outputs[0].token_ids == alone
    # Different seeds give different streams; n > 1 gives distinct samples.
    other_seed = llm.generate([prompt], seeded.clone(seed=99))[0].outputs[0].token_ids
    assert other_seed != alone
    multi = llm.generate([prompt], seeded.clone(n=3))[0]
    assert multi.outputs[0].token_ids == alone
    assert len({tuple(c.token_ids) for c in multi.outputs}) == 3


def test_stop_token_ids_and_eos(llm):
    prompt = random_prompts(512, (12,), seed=33)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[
        0
    ].outputs[0]
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at])
    )[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    # min_tokens forbids stopping early: the stop token is masked until then.
    late = llm.generate(
        [prompt],
        SamplingParams(max_tokens=12, temperature=0, min_tokens=12, stop_token_ids=[stop_at]),
    )[0].outputs[0]
    assert len(late.token_ids) == 12 and stop_at not in late.token_ids


def test_stop_strings_cut_the_text(llm):
    prompt = random_prompts(512, (20,), seed=34)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[
        0
    ].outputs[0]
    text = free.text
    stop = text[5:8]
    cut = text.index(stop)
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=16, temperature=0, stop=[stop], ignore_eos=True)
    )[0].outputs[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(
        [prompt],
        SamplingParams(
            max_tokens=16,
            temperature=0,
            stop=stop,
            include_stop_str_in_output=True,
            ignore_eos=True,
        ),
    )[0].outputs[0]
    assert kept.text == text[: cut + len(stop)]


def test_an_engine_without_text_still_stops_on_stop_strings(llm, model_dir):
    # a mesh's workers run the engine with detokenize=False: the gateway makes the
    # text, but a stop string must still end the sequence where the engine is
    prompt = random_prompts(512, (20,), seed=34)[0]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    free = llm.generate([prompt], params)[0].outputs[0]
    stop = free.text[5:8]
    quiet = LLM(model_dir("tiny-qwen3"), dtype="float32", device="cpu", detokenize=False)
    plain = quiet.generate([prompt], params)[0].outputs[0]
    assert plain.token_ids == free.token_ids and plain.text == ""
    stopped = quiet.generate([prompt], SamplingParams(max_tokens=16, temperature=0,
                                                      stop=[stop], ignore_eos=True))  # fmt: skip
    expected = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0,
                                                     stop=[stop], ignore_eos=True))  # fmt: skip
    assert stopped[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert len(stopped[0].outputs[0].token_ids) < 16
    assert stopped[0].outputs[0].stop_reason == stop


def test_max_tokens_and_length_finish(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[
        0
    ].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_eos_stops_unless_ignored(model_dir, async_scheduling):
    llm = LLM(
        model_dir("tiny-qwen3"), dtype="float32", device="cpu", async_scheduling=async_scheduling
    )
    prompt = random_prompts(512, (8,), seed=35)[0]
    free = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[
        0
    ].outputs[0]
    # Declare a token the model produces to be its EOS.
    eos = free.token_ids[6]
    end = free.token_ids.index(eos)
    llm.engine.eos_token_ids = frozenset({eos})
    stopped = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0))[0].outputs[0]
    assert stopped.token_ids == free.token_ids[: end + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    ignored = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[
        0
    ].outputs[0]
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"
