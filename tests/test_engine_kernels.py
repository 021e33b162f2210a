"""The engine on the Triton kernels (through Triton's interpreter on CPU)
agrees with itself on the torch references, including the padded static
buffers the decode CUDA graphs replay over."""

from __future__ import annotations

import pytest
import torch
from test_hf_parity import engine_logits, random_prompts

from engine import LLM, SamplingParams
from engine.cuda_graphs import DecodeGraphs, batch_buckets
from kernels import ops

PARAMS = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-moe", "tiny-deepseek-v2", "tiny-deepseek-v3"])
def test_kernels_equal_references(model_dir, name):
    prompts = random_prompts(500, (1, 19, 40), seed=71)
    ref = LLM(model_dir(name), device="cpu")
    fast = LLM(model_dir(name), device="cpu", kernels="triton")
    assert fast.engine.runner.backend.name == "triton"
    assert [o.outputs[0].token_ids for o in fast.generate(prompts, PARAMS)] == [
        o.outputs[0].token_ids for o in ref.generate(prompts, PARAMS)
    ]
    for got, want in zip(
        engine_logits(fast.engine, prompts[1], 2), engine_logits(ref.engine, prompts[1], 2)
    ):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_batch_buckets():
    assert batch_buckets(256)[:6] == [1, 2, 4, 8, 16, 32] and batch_buckets(256)[-1] == 256
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(3) == [1, 2, 3]


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-deepseek-v3"])  # K/V and latent caches
def test_padded_decode_buffers_give_the_unpadded_logits(model_dir, name):
    llm = LLM(model_dir(name), device="cpu", kernels="triton")
    engine, runner = llm.engine, llm.engine.runner
    for i, prompt in enumerate(random_prompts(500, (5, 30, 17), seed=72)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    while any(s.in_prefill for s in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    batch = engine.scheduler.schedule()
    assert len(batch.seqs) == 3
    tables = [engine.kv.block_ids(s) for s in batch.seqs]
    inputs = runner.prepare(batch.seqs, batch.num_new_tokens, tables)
    assert inputs.meta.decode_only
    graphs = DecodeGraphs(runner, max_batch=8, max_seq_len=256)
    with ops.using("triton"):
        padded = graphs.run(inputs.input_ids, inputs.positions, inputs.meta)  # bucket of 4
        eager = runner.model.compute_logits(runner.forward(inputs))
    torch.testing.assert_close(padded, eager, atol=1e-4, rtol=1e-4)
