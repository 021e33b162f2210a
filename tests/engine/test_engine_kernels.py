"""The engine on the Triton kernels (through Triton's interpreter on CPU)
agrees with itself on the torch references, including the padded static
buffers the decode CUDA graphs replay over."""

from __future__ import annotations

import pytest
import torch
from prompts import engine_logits, random_prompts

from engine import LLM, SamplingParams
from engine.cuda_graphs import DecodeGraphs, batch_buckets
from engine.sequence import Sequence
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


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-v3"])  # K/V and latent caches
def test_prompt_chunks_as_decode_rows_give_the_chunks_logits(model_dir, name):
    """A step of a decode and a prompt chunk after a cached prefix, laid out a row per
    token for the decode graphs, gives the eager varlen step's logits."""
    llm = LLM(model_dir(name), device="cpu", kernels="triton")
    engine, runner = llm.engine, llm.engine.runner
    first, second = random_prompts(500, (21, 7), seed=73)
    engine.add_request("a", first, SamplingParams(max_tokens=20, ignore_eos=True))
    while any(s.in_prefill for s in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    engine.add_request("b", first[:16] + second, SamplingParams(max_tokens=4, ignore_eos=True))
    batch = engine.scheduler.schedule()
    assert batch.num_new_tokens == [1, 7] and batch.seqs[1].num_computed_tokens == 16
    tables = [engine.kv.block_ids(s) for s in batch.seqs]
    rows = runner.prepare(batch.seqs, batch.num_new_tokens, tables, as_rows=True)
    assert rows.meta.decode_only and rows.meta.seq_lens_cpu[1:] == list(range(17, 24))
    varlen = runner.prepare(batch.seqs, batch.num_new_tokens, tables)
    graphs = DecodeGraphs(runner, max_batch=16, max_seq_len=256)
    with ops.using("triton"):
        eager = runner.model.compute_logits(runner.forward(varlen))
        padded = graphs.run(rows.input_ids, rows.positions, rows.meta)
    torch.testing.assert_close(padded, eager, atol=1e-4, rtol=1e-4)


def test_an_engine_with_decode_graphs_answers_as_without(model_dir):
    """Short prompts and prompts that extend a cached prefix run as decode-graph rows
    (replayed eagerly on the CPU); the greedy answers are the plain engine's."""
    folder = model_dir("tiny-llama")
    prompts = random_prompts(500, (3, 40, 9), seed=74)
    prompts.append(prompts[1][:32] + prompts[2])  # 32 tokens cached, 9 new
    ref = LLM(folder, device="cpu")
    want = [ref.generate([p], PARAMS)[0].outputs[0].token_ids for p in prompts]
    llm = LLM(folder, device="cpu", kernels="triton")
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner, max_batch=16, max_seq_len=256)
    launched = []
    prepare = runner.prepare
    runner.prepare = lambda *a: launched.append(a[3]) or prepare(*a)
    got = [llm.generate([p], PARAMS)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in got] == want
    assert got[3].num_cached_tokens == 32
    # the 3-token prompt and the 9 tokens after the cached 32 as rows; 40 do not fit 16
    assert launched[0] is True and launched[-5] is True and launched[5] is False


def test_prompt_rows_run_beside_decodes_only_when_they_read_little_more(model_dir):
    """Alone, a chunk after a cached prefix runs as rows while their reads stay within
    twice the weights' bytes; beside a decode, only while what the rows read beyond
    the eager pass stays within a quarter of them."""
    llm = LLM(model_dir("tiny-llama"), device="cpu")
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner, max_batch=16, max_seq_len=512)
    per_weights = runner.weight_bytes / runner.kv_spec.bytes_per_token  # tokens' worth

    def seq(cached: int) -> Sequence:
        s = Sequence("s", "s", 0, list(range(cached + 9)), SamplingParams(), frozenset())
        s.num_computed_tokens = cached
        return s

    long, short = int(per_weights * 0.15), int(per_weights * 0.01)
    assert runner.rows_pay([seq(long)], [9])  # alone: 9 rows over ~0.15 W each
    assert not runner.rows_pay([seq(long), seq(50)], [9, 1])  # beside a decode: 8 x 0.15 W more
    assert runner.rows_pay([seq(short), seq(50)], [9, 1])  # 8 x 0.01 W more
    assert not runner.rows_pay([seq(int(per_weights * 0.3))], [9])  # alone, past 2 W
    assert not runner.rows_pay([seq(short), seq(50)], [16, 1])  # 17 rows: past the graphs
    runner.config.graph_prompt_rows = False
    assert not runner.rows_pay([seq(short)], [9])
