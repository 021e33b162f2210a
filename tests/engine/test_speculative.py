"""Speculative decoding (engine/speculative.py): greedy outputs equal to no
speculation for every preset and method, with prefix hits, chunked prefill,
preemption and a prefill/decode split; sampled outputs keep their
distribution; bad settings are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prompts import quoting_prompts
from test_engine_disaggregation import handoff

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.draft_trie import DraftTrie
from engine.make_model import TINY_PRESETS
from engine.model_runner import graph_rows
from engine.speculative import ngram_drafts

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

VARIANTS = {
    "ngram": dict(speculative_method="ngram"),
    "trie": dict(speculative_method="trie", prompt_lookup_min=1),
    "ngram-k7-chunk-7": dict(
        speculative_method="ngram",
        num_speculative_tokens=7,
        prompt_lookup_min=1,
        max_prefill_chunk=7,
    ),  # fmt: skip
    # Room for about two sequences at once: the rest wait or are preempted.
    "ngram-preemption": dict(
        speculative_method="ngram",
        num_gpu_blocks=24,
        max_num_batched_tokens=256,
        prompt_lookup_min=1,
    ),  # fmt: skip
}


def generate(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module", params=TINY_PRESETS)
def reference(request, model_dir):
    """Each preset's greedy outputs without speculation: a first round, then a second
    whose prompts extend the first's prompts and outputs (prefix hits)."""
    folder = model_dir(request.param)
    llm = LLM(folder, dtype="float32", device="cpu")
    prompts = quoting_prompts(llm.engine.model_config.vocab_size)
    first = generate(llm, prompts)
    second_prompts = [p + o[:20] + p[:5] for p, o in zip(prompts, first)]
    return folder, prompts, first, second_prompts, generate(llm, second_prompts)


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_outputs_equal_no_speculation(reference, variant):
    folder, prompts, first, second_prompts, second = reference
    llm = LLM(folder, dtype="float32", device="cpu", **VARIANTS[variant])
    assert generate(llm, prompts) == first
    assert generate(llm, second_prompts) == second
    stats = llm.get_stats()
    assert stats["spec_accepted_tokens"] > 0  # drafts were kept: the path ran
    assert stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]  # and some rolled back
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["kv_blocks_used"] == 0
    if variant.endswith("preemption"):
        assert stats["num_preemptions"] > 0


MTP_VARIANTS = {
    "mtp": dict(speculative_method="mtp"),
    "mtp-k1-chunk-7": dict(
        speculative_method="mtp", num_speculative_tokens=1, max_prefill_chunk=7
    ),  # fmt: skip
    "mtp-preemption": dict(
        speculative_method="mtp", num_gpu_blocks=24, max_num_batched_tokens=256
    ),  # fmt: skip
}


@pytest.mark.parametrize("variant", MTP_VARIANTS)
def test_mtp_greedy_outputs_equal_no_speculation(model_dir, variant):
    """tiny-deepseek-v3 carries an MTP layer (random: its drafts are seldom kept)."""
    folder = model_dir("tiny-deepseek-v3")
    prompts = quoting_prompts(500, count=8, seed=3)
    expected = generate(LLM(folder, dtype="float32", device="cpu"), prompts)
    llm = LLM(folder, dtype="float32", device="cpu", **MTP_VARIANTS[variant])
    assert generate(llm, prompts) == expected
    stats = llm.get_stats()
    assert stats["spec_draft_tokens"] > 0 and stats["kv_blocks_used"] == 0
    if variant.endswith("preemption"):
        assert stats["num_preemptions"] > 0


def test_mtp_drafts_do_not_depend_on_how_the_prompt_was_computed(model_dir, monkeypatch):
    """The MTP layer's own KV is filled step by step (prompt chunks, verified drafts
    rolled back, recompute after preemption): its drafts at every step equal those of
    an engine that computed each prompt in one step and never preempted (as far as
    each chain goes: a chain stops where its sequence's blocks end)."""
    from engine.speculative import Drafter

    seen: list[list] = []
    propose = Drafter.propose

    def recording(self, seqs):
        propose(self, seqs)
        seen[-1].extend((s.request_id, len(s.all_token_ids), tuple(s.draft_token_ids))
                        for s in seqs if s.draft_token_ids)  # fmt: skip

    monkeypatch.setattr(Drafter, "propose", recording)
    folder = model_dir("tiny-deepseek-v3")
    prompts = quoting_prompts(500, count=6, seed=5)
    runs = []
    for options in ({}, {"max_prefill_chunk": 5},
                    {"num_gpu_blocks": 20, "max_num_batched_tokens": 256}):  # fmt: skip
        seen.append([])
        llm = LLM(folder, dtype="float32", device="cpu", speculative_method="mtp",
                  num_speculative_tokens=3, enable_prefix_caching=False, **options)  # fmt: skip
        runs.append(generate(llm, prompts))
    assert runs[0] == runs[1] == runs[2]
    drafts = [dict(((rid, n), d) for rid, n, d in run) for run in seen]
    common = set(drafts[0]) & set(drafts[1]) & set(drafts[2])
    assert len(common) > 50
    for key in common:  # a chain stops where the sequence's blocks end: compare the start
        a, b, c = (d[key] for d in drafts)
        n = min(map(len, (a, b, c)))
        assert a[:n] == b[:n] == c[:n], key


def test_mtp_needs_a_checkpoint_with_the_layer(model_dir):
    with pytest.raises(ValueError, match="multi-token prediction"):
        LLM(model_dir("tiny-deepseek-v2"), device="cpu", speculative_method="mtp")


def test_prefill_decode_split_equals_one_engine(model_dir):
    folder = model_dir("tiny-llama")
    cfg = dict(dtype="float32", device="cpu", speculative_method="ngram", prompt_lookup_min=1)
    prefill, decode = LLMEngine(folder, EngineConfig(**cfg)), LLMEngine(folder, EngineConfig(**cfg))
    prompts = quoting_prompts(500, count=4, seed=8)
    expected = LLM(folder, dtype="float32", device="cpu").generate(prompts, GREEDY)
    for i, (prompt, exp) in enumerate(zip(prompts, expected)):
        _, out = handoff(prefill, decode, f"r{i}", prompt, GREEDY)
        assert out.outputs[0].token_ids == exp.outputs[0].token_ids
        assert prefill.release_held(f"r{i}")
    assert prefill.get_stats()["spec_draft_tokens"] == 0  # a prefill's only token: no drafts
    assert decode.get_stats()["spec_accepted_tokens"] > 0
    assert decode.get_stats()["kv_blocks_used"] == 0


def test_logprobs_with_drafts_equal_no_speculation(model_dir):
    """Every token, a kept draft's too, comes with its logprobs, as without drafts."""
    folder = model_dir("tiny-llama")
    prompts = quoting_prompts(500, count=6, seed=3)
    params = GREEDY.clone(max_tokens=30, logprobs=3)
    off = LLM(folder, dtype="float32", device="cpu").generate(prompts, params)
    llm = LLM(folder, dtype="float32", device="cpu", speculative_method="ngram",
              prompt_lookup_min=1)  # fmt: skip
    on = llm.generate(prompts, params)
    assert llm.get_stats()["spec_accepted_tokens"] > 0
    for a, b in zip((o.outputs[0] for o in off), (o.outputs[0] for o in on)):
        assert a.token_ids == b.token_ids and len(b.logprobs) == len(b.token_ids)
        assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-4)
        for want, got in zip(a.logprobs, b.logprobs):
            assert {t: v.rank for t, v in got.items()} == {t: v.rank for t, v in want.items()}
            for t, v in want.items():
                assert got[t].logprob == pytest.approx(v.logprob, abs=1e-4)


def _exact_distribution(llm: LLM, prompt: list[int], depth: int, top_k: int) -> dict:
    """P(first `depth` tokens) under temperature 1 and top_k, from the model's logprobs."""
    probs = {(): 1.0}
    for _ in range(depth):
        prefixes = list(probs)
        params = SamplingParams(max_tokens=1, temperature=0, logprobs=top_k)
        outs = llm.generate([prompt + list(p) for p in prefixes], params)
        nxt = {}
        for prefix, out in zip(prefixes, outs):
            top = out.outputs[0].logprobs[0]
            best = sorted(top.items(), key=lambda kv: kv[1].rank)[:top_k]
            weights = torch.tensor([lp.logprob for _, lp in best]).softmax(0).tolist()
            for (tid, _), w in zip(best, weights):
                nxt[prefix + (tid,)] = probs[prefix] * w
        probs = nxt
    return probs


def test_sampled_outputs_keep_their_distribution(model_dir):
    """The first three tokens of 3,000 sampled requests (top-k 3: 27 outcomes) with
    drafts from the trie fit the model's exact distribution (chi-square, p > 0.001);
    most steps verify drafts, so a wrong acceptance rule would show."""
    folder = model_dir("tiny-llama")
    prompt = [11, 42, 7, 99, 11, 42, 7, 99, 11, 42]
    exact = _exact_distribution(LLM(folder, dtype="float32", device="cpu"), prompt, 3, 3)
    llm = LLM(folder, dtype="float32", device="cpu", max_num_seqs=256,
              speculative_method="trie", num_speculative_tokens=3)  # fmt: skip

    def sample(seeds) -> list[tuple[int, ...]]:
        # unseeded: a seeded request gets no drafts (its tokens stay its seed's)
        params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=3, ignore_eos=True)
                  for _ in seeds]  # fmt: skip
        outs = llm.generate([prompt] * len(seeds), params)
        return [tuple(o.outputs[0].token_ids[:3]) for o in outs]

    sample(range(300))  # the trie learns these requests' outputs
    before = llm.get_stats()["spec_draft_tokens"]
    got = sample(range(1000, 4000))
    stats = llm.get_stats()
    assert stats["spec_draft_tokens"] - before > 3000  # drafts for most requests
    counts = {key: 0 for key in exact}
    for key in got:
        counts[key] += 1  # KeyError: a sequence the model's top-3 cannot make
    n = len(got)
    observed, expected = [], []
    small_o = small_e = 0.0
    for key, p in exact.items():  # cells expected below 5 pooled
        if p * n < 5:
            small_o, small_e = small_o + counts[key], small_e + p * n
        else:
            observed.append(counts[key])
            expected.append(p * n)
    if small_e:
        observed.append(small_o)
        expected.append(small_e)
    o, e = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    chi2 = float(((o - e) ** 2 / e).sum())
    df = len(observed) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(chi2 / 2.0)))
    assert p_value > 1e-3, (chi2, df)


def test_seeded_requests_keep_their_tokens(model_dir):
    """A seeded sampled request answers the same with speculation on or off, also
    after the trie has learned other answers to its prompt (it gets no drafts: drafts
    rejected would use up its generator's draws)."""
    folder = model_dir("tiny-llama")
    prompt = quoting_prompts(500, count=1, seed=4)[0]
    params = [SamplingParams(max_tokens=30, temperature=0.7, seed=s, ignore_eos=True)
              for s in range(1, 9)]  # fmt: skip
    off = LLM(folder, dtype="float32", device="cpu").generate([prompt] * 8, params)
    llm = LLM(folder, dtype="float32", device="cpu", speculative_method="trie")
    for i in range(8):  # one at a time: each after the trie learned the ones before
        got = llm.generate([prompt], params[i])[0].outputs[0].token_ids
        assert got == off[i].outputs[0].token_ids, i


def test_drafts_take_only_the_budget_nothing_else_needs(model_dir):
    """With a step budget of 8 tokens, drafting sequences leave room for every other
    running sequence's token and for admitting the waiting ones."""
    llm = LLM(model_dir("tiny-llama"), dtype="float32", device="cpu", max_num_batched_tokens=8,
              speculative_method="trie")  # fmt: skip
    engine = llm.engine
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompts = [[5 + i, 6, 5 + i, 6] for i in range(4)]
    llm.generate(prompts, params)  # the trie learns the answers: every decode has 4 drafts
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    made: dict[str, int] = {}
    for _ in range(6):  # two steps of prompts, then every request decodes
        for out in engine.step():
            made[out.request_id] = len(out.outputs[0].token_ids)
    assert sorted(made) == ["r0", "r1", "r2", "r3"] and min(made.values()) >= 2, made
    assert engine.get_stats()["spec_draft_tokens"] > 0
    while engine.has_unfinished_requests():
        engine.step()


def test_prompt_lookup_takes_the_latest_longest_match():
    tokens = np.array([5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 2, 3])
    # suffix [4, 2, 3] never occurred; [2, 3] did, last at 7: followed by 7, 8, 4
    assert ngram_drafts(tokens, 3, 2, 3) == [7, 8, 4]
    assert ngram_drafts(tokens, 9, 2, 3) == [7, 8, 4, 2, 3]
    assert ngram_drafts(tokens, 3, 3, 4) == []
    assert ngram_drafts(np.array([1]), 3, 1, 2) == []


def test_trie_drafts_the_most_frequent_continuation():
    trie = DraftTrie(1, 2)
    trie.add(np.array([1, 2, 3, 4]))
    trie.add(np.array([1, 2, 3, 5]))
    trie.add(np.array([9, 2, 3, 5]))
    assert trie.drafts(np.array([7, 1, 2]), 3) == [3, 5]
    assert trie.drafts(np.array([8]), 3) == []
    small = DraftTrie(1, 1, capacity=2)
    small.add(np.array([1, 2, 3, 4]))
    assert len(small) == 2 and small.drafts(np.array([1]), 1) == []  # the oldest went


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(speculative_method="medusa"), "speculative_method"),
        (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(speculative_method="ngram", prompt_lookup_min=4, prompt_lookup_max=2), "lookup"),
        (dict(speculative_method="ngram", pipeline_parallel_size=2), "pipeline_parallel_size"),
        (dict(speculative_method="ngram", async_scheduling=True), "async_scheduling"),
        (dict(speculative_method="ngram", model_runner="mock"), "model_runner"),
    ],
)
def test_bad_settings_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_verify_steps_fit_the_decode_graphs():
    """A verify step is a row per token: the graphs take every decoding sequence's
    drafts (up to 512 rows), and no fewer rows than without speculation."""
    assert graph_rows(EngineConfig(max_num_seqs=8)) == 8
    assert graph_rows(EngineConfig(max_num_seqs=8, speculative_method="ngram")) == 40
    assert graph_rows(EngineConfig(speculative_method="ngram")) == 512  # 256 x 5, capped
    assert graph_rows(EngineConfig(max_num_seqs=1024, speculative_method="ngram")) == 1024
