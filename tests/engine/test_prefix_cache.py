"""Automatic prefix caching: a second request sharing a 200-token prefix
reuses at least 192 tokens and the model runs only on the rest; namespaces
(tenants) never share."""

from __future__ import annotations

from prompts import random_prompts

from engine import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def test_second_request_reuses_shared_prefix(model_dir):
    llm = LLM(model_dir("tiny-qwen3"), dtype="float32", device="cpu")
    prefix, tail_a, tail_b = random_prompts(512, (200, 30, 25), seed=21)
    first = llm.generate([prefix + tail_a], PARAMS)[0]
    assert first.num_cached_tokens == 0
    before = llm.get_stats()["num_tokens_processed"]

    second = llm.generate([prefix + tail_b], PARAMS)[0]
    processed = llm.get_stats()["num_tokens_processed"] - before
    assert second.num_cached_tokens >= 192
    # Only the uncached prompt tokens, then one token per further decode step.
    assert processed == (225 - second.num_cached_tokens) + (PARAMS.max_tokens - 1)
    # And the answer is what an engine without the cache gives.
    cold = LLM(model_dir("tiny-qwen3"), dtype="float32", device="cpu", enable_prefix_caching=False)
    assert (
        second.outputs[0].token_ids
        == cold.generate([prefix + tail_b], PARAMS)[0].outputs[0].token_ids
    )
    stats = llm.get_stats()
    assert stats["prefix_cache_hit_tokens"] == second.num_cached_tokens
    assert stats["prefix_cache_queried_tokens"] == 230 + 225


def test_namespaces_do_not_share(model_dir):
    llm = LLM(model_dir("tiny-qwen3"), dtype="float32", device="cpu")
    engine = llm.engine
    prompt = random_prompts(512, (100,), seed=22)[0]
    for request_id, tenant in (("a", "tenant-a"), ("b", "tenant-b"), ("c", "tenant-a")):
        engine.add_request(request_id, prompt, PARAMS, namespace=tenant)
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs[out.request_id] = out
        assert outs[request_id].num_cached_tokens == (96 if request_id == "c" else 0)


def test_identical_prompt_leaves_last_token_to_compute(model_dir):
    llm = LLM(model_dir("tiny-llama"), dtype="float32", device="cpu")
    prompt = random_prompts(512, (64,), seed=23)[0]  # exactly 4 blocks
    a = llm.generate([prompt], PARAMS)[0]
    b = llm.generate([prompt], PARAMS)[0]
    assert b.num_cached_tokens == 48  # the last block is recomputed for its logits
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_public_prefix_is_shared_by_every_tenant_and_nothing_else(model_dir):
    """An operator's public prefix (a system prompt) is cached for everyone; the
    blocks after it stay the tenant's."""
    llm = LLM(model_dir("tiny-qwen3"), dtype="float32", device="cpu")
    engine = llm.engine
    system, question = random_prompts(512, (70, 60), seed=23)
    prompt = system + question
    want = llm.generate([prompt], PARAMS)[0].outputs[0].token_ids

    def run(request_id, tenant):
        engine.add_request(request_id, prompt, PARAMS, namespace=tenant, public_tokens=70)
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs[out.request_id] = out
        return outs[request_id]

    a = run("a", "tenant-a")
    assert a.num_cached_tokens == 0  # the public blocks are new; the earlier run was private
    b = run("b", "tenant-b")
    assert b.num_cached_tokens == 64  # the 4 blocks wholly inside the 70 public tokens
    c = run("c", "tenant-a")
    assert c.num_cached_tokens == 128  # its own blocks too
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids == want
