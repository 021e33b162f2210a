"""Tensor parallelism inside one engine: real processes (one per rank), gloo.
Greedy outputs (float32) equal the unsharded engine's for every preset, with
prefix hits, chunked prefill and preemption; each rank holds 1/T of the
sharded weights; bad sizes are refused before anything starts."""

from __future__ import annotations

import pytest
import torch
from prompts import random_prompts

from basis.model_config import ModelConfig
from engine import LLM, SamplingParams
from engine.parallel.sharding import ShardPlan
from engine.parallel.stages import StagePlan

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
MODELS = ("tiny-llama", "tiny-qwen3", "tiny-moe", "tiny-deepseek-v2", "tiny-deepseek-v3")


def workload() -> list[list[int]]:
    shared = random_prompts(500, (40,), seed=90)[0]
    tails = random_prompts(500, (1, 9, 33, 70), seed=91)
    return [shared + t for t in tails] + random_prompts(500, (5, 100), seed=92)


# chunks of 7; a 16-block pool forces preemption
OPTIONS = dict(device="cpu", dtype="float32", max_prefill_chunk=7, num_gpu_blocks=16)


def run(llm: LLM) -> list[list[int]]:
    """The first prompt alone, then the rest: they hit its cached prefix."""
    prompts = workload()
    outs = llm.generate(prompts[:1], GREEDY) + llm.generate(prompts[1:], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def references(model_dir):
    out = {}
    for name in {m for m, _, _ in MATRIX}:
        llm = LLM(model_dir(name), **OPTIONS)
        out[name] = run(llm)
        llm.close()
    return out


# (preset, tensor parallel size, pipeline parallel size)
MATRIX = [
    ("tiny-llama", 2, 1),
    ("tiny-qwen3", 4, 1),
    ("tiny-deepseek-v2", 2, 1),
    ("tiny-llama", 1, 2),
    ("tiny-moe", 1, 3),
    ("tiny-deepseek-v3", 1, 3),
    ("tiny-moe", 2, 2),
]


@pytest.mark.parametrize(("name", "tp", "pp"), MATRIX, ids=lambda v: str(v))
def test_parallel_equals_one_process(model_dir, references, name, tp, pp):
    llm = LLM(model_dir(name), tensor_parallel_size=tp, pipeline_parallel_size=pp, **OPTIONS)
    try:
        got = run(llm)
        stats = llm.get_stats()
    finally:
        llm.close()
    assert got == references[name]
    assert stats["prefix_cache_hit_tokens"] > 0 and stats["num_preemptions"] > 0
    assert stats["host_kv_blocks_total"] == 0  # rank 0 holds part of each block: no host tier


@pytest.mark.parametrize("name", ("tiny-llama", "tiny-moe", "tiny-deepseek-v3"))
def test_each_rank_holds_its_share_of_the_weights(model_dir, name):
    full = ModelConfig.from_pretrained(model_dir(name))
    whole = LLM(model_dir(name), device="cpu", dtype="float32", host_kv_cache_gb=0)
    whole_bytes = _sharded_bytes(whole.engine.runner.model)
    whole.close()
    tp = 2
    llm = LLM(model_dir(name), device="cpu", dtype="float32", tensor_parallel_size=tp,
              host_kv_cache_gb=0)  # fmt: skip
    try:
        rank0 = _sharded_bytes(llm.engine.runner.model)
    finally:
        llm.close()
    assert rank0 == pytest.approx(whole_bytes / tp, rel=0.02)
    assert ShardPlan(full, tp, 0).config.num_attention_heads == full.num_attention_heads // tp


def _sharded_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters tensor parallelism splits (norms and routers are whole
    on every rank)."""
    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "w13", "w2", "q_b_proj",
             "kv_b_proj", "embed_tokens", "lm_head")  # fmt: skip
    seen, total = set(), 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if name.split(".")[-1] in names and p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def test_a_pipeline_keeps_a_step_in_flight_per_stage(model_dir, monkeypatch):
    """Two stages and a full queue: nearly every step is launched while the previous
    one is still in the pipeline, over other sequences (how busy each stage then is
    is a speed figure: bench/gpu/parallel.py's pp_throughput section)."""
    from engine.stepping import Stepper

    launches: list[tuple[int, set, set]] = []  # (steps in flight, their seqs, this step's)
    real_launch = Stepper.launch

    def recording_launch(stepper):
        in_flight = {id(s) for step in stepper.pipeline for s in step.seqs}
        step = real_launch(stepper)
        if step is not None:
            launches.append((len(stepper.pipeline), in_flight, {id(s) for s in step.seqs}))
        return step

    monkeypatch.setattr(Stepper, "launch", recording_launch)
    llm = LLM(model_dir("tiny-llama"), device="cpu", dtype="float32", pipeline_parallel_size=2)
    try:
        prompts = random_prompts(500, [24] * 16, seed=93)
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        outs = llm.generate(prompts, params)
    finally:
        llm.close()
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    overlapped = [n for n, _, _ in launches if n == 1]
    assert len(overlapped) >= 0.8 * len(launches), (len(overlapped), len(launches))
    assert all(not (flying & mine) for _, flying, mine in launches)  # never a sequence twice


def test_sizes_that_do_not_divide_the_model_are_refused(model_dir):
    full = ModelConfig.from_pretrained(model_dir("tiny-llama"))  # 4 heads, 2 kv heads
    with pytest.raises(ValueError, match="num_attention_heads"):
        ShardPlan(full, 3, 0)
    assert ShardPlan(full, 4, 3).kv_heads == (1, 2)  # 4 ranks share 2 kv heads
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model_dir("tiny-llama"), device="cpu", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="2 layers"):  # tiny-llama has 2
        StagePlan(2, 3, 0)
