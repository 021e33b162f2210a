"""Scheduling choices never change what greedy decoding produces: prefix
caching on or off, chunked prefill at several chunk sizes or off, forced
preemption, batch size 1 or 32, n > 1, async scheduling."""

from __future__ import annotations

import pytest
from prompts import PROMPT_LENGTHS, random_prompts

from engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

VARIANTS = {
    "prefix-caching-off": dict(enable_prefix_caching=False),
    "chunk-1": dict(max_prefill_chunk=1),
    "chunk-7": dict(max_prefill_chunk=7),
    "chunk-64": dict(max_prefill_chunk=64),
    "chunked-prefill-off": dict(enable_chunked_prefill=False, max_num_batched_tokens=4096),
    "batch-1": dict(max_num_seqs=1),
    "batch-32": dict(max_num_seqs=32),
    # Room for about two of the longest sequences at once: the rest must wait or be preempted.
    "forced-preemption": dict(num_gpu_blocks=44, max_num_batched_tokens=512),
    # Each step queued before the last is read back, its inputs fed from the last's tokens.
    "async-scheduling": dict(async_scheduling=True),
    "async-forced-preemption": dict(
        async_scheduling=True, num_gpu_blocks=44, max_num_batched_tokens=512
    ),
    "async-chunk-7": dict(async_scheduling=True, max_prefill_chunk=7),
}


def prompts_for(llm: LLM) -> list[list[int]]:
    # Shared prefixes make prefix caching matter; 36 prompts exceed batch size 32.
    base = random_prompts(llm.engine.model_config.vocab_size, PROMPT_LENGTHS, seed=11)
    shared = [base[8][:100] + p for p in base[:6]]
    extra = random_prompts(llm.engine.model_config.vocab_size, [5, 9, 48] * 7, seed=12)
    return base + shared + extra


@pytest.fixture(
    scope="module", params=["tiny-llama", "tiny-moe", "tiny-deepseek-v2", "tiny-deepseek-v3"]
)
def reference(request, model_dir):
    folder = model_dir(request.param)
    llm = LLM(folder, dtype="float32", device="cpu")
    prompts = prompts_for(llm)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    return folder, prompts, outputs


@pytest.mark.parametrize("variant", VARIANTS)
def test_same_outputs(reference, variant):
    folder, prompts, expected = reference
    llm = LLM(folder, dtype="float32", device="cpu", **VARIANTS[variant])
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == expected
    stats = llm.get_stats()
    if variant.endswith("forced-preemption"):
        assert stats["num_preemptions"] > 0
    if variant == "prefix-caching-off":
        assert stats["prefix_cache_hit_tokens"] == 0
    assert stats["kv_blocks_used"] == 0  # everything was freed


def test_n_greater_than_one_shares_prompt_blocks(reference):
    folder, prompts, expected = reference
    llm = LLM(folder, dtype="float32", device="cpu", enable_prefix_caching=False)
    prompt = prompts[8]  # 200 tokens
    out = llm.generate(
        [prompt], SamplingParams(n=3, max_tokens=10, temperature=0, ignore_eos=True)
    )[0]
    assert [c.token_ids for c in out.outputs] == [expected[8]] * 3
    assert [c.index for c in out.outputs] == [0, 1, 2]
    processed = llm.get_stats()["num_tokens_processed"]
    # The first sequence computes the prompt; the others only its last partial block.
    tail = len(prompt) - (len(prompt) - 1) // 16 * 16
    assert processed == len(prompt) + 2 * tail + 3 * 9
