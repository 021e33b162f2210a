"""Start-up warm-up: every prefill shape bucket a step can hold, run once
without touching anything a request can see."""

from __future__ import annotations

import time

import torch

from engine import LLM, SamplingParams
from engine.startup import StartupPhases
from engine.warmup import layers_of_each_kind, warm_up, warmup_shapes
from kernels.selection import next_power_of_2


def test_shapes_cover_every_power_of_two_bucket_within_the_budget():
    shapes = warmup_shapes(8192, 256, 40960)
    assert all(sum(q) <= 8192 and len(q) <= 256 and max(q) >= 2 for q in shapes)
    uniform = {(len(q), q[0]) for q in shapes if len(set(q)) == 1}
    mixed = {(len(q), q[0]) for q in shapes if len(set(q)) > 1}
    assert {(1, 8192), (256, 32), (128, 64)} <= uniform
    assert len(uniform) == 81  # 13 + 12 + ... + 5 lengths for 1, 2, ..., 256 prompts
    # One prompt beside decode rows: the buckets of chunked-prefill steps.
    assert {(256, 4096), (2, 4096), (256, 2)} <= mixed
    # A chunk filling what decode rows leave of the budget: bucket 8192 beside 1..255
    # rows (one of 8185 tokens beside 7 rows is bucket (8, 8192)).
    assert {(2, 8191), (8, 8185), (256, 7937)} <= mixed
    # Every (rows, longest query) bucket a step within the budget can fall in is run.
    run = {(next_power_of_2(len(q)), next_power_of_2(max(q))) for q in shapes}
    reachable = {(b, n) for b in [2**i for i in range(9)] for n in [2**i for i in range(1, 14)]
                 if b // 2 + 1 <= n and n // 2 + 1 + b // 2 <= 8192}  # fmt: skip
    assert reachable <= run and (2, 8192) in run
    assert all(q[1:] == [1] * (len(q) - 1) for q in shapes if len(set(q)) > 1)
    # Capped by the model's length and the batch size.
    assert max(max(q) for q in warmup_shapes(8192, 4, 512)) == 512
    assert max(len(q) for q in warmup_shapes(8192, 4, 512)) == 4


def test_warm_up_leaves_outputs_cache_and_counters_unchanged(model_dir):
    opts = dict(dtype="float32", device="cpu", max_num_batched_tokens=64, max_num_seqs=4)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9] * 7, [11, 12, 13]]
    expected = [o.outputs[0].token_ids for o in LLM(model_dir("tiny-llama"), **opts).generate(
        prompts, params
    )]  # fmt: skip

    llm = LLM(model_dir("tiny-llama"), **opts)
    runner = llm.engine.runner
    before = [c.clone() for c in runner.kv_caches]
    processed = runner.num_tokens_processed
    warm_up(runner, max_len=64)
    for old, new in zip(before, runner.kv_caches):
        assert torch.equal(old[1:], new[1:]), "warm-up wrote outside the null block"
    assert runner.num_tokens_processed == processed
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected


def test_warm_up_runs_one_layer_of_each_kind_and_gives_the_model_back(model_dir):
    # DeepSeek-V2's tiny preset: a dense first layer, then MoE layers
    opts = dict(dtype="float32", device="cpu", max_num_batched_tokens=32, max_num_seqs=2)
    llm = LLM(model_dir("tiny-deepseek-v2"), **opts)
    runner = llm.engine.runner
    layers = list(runner.model.layers)
    kinds = [type(layer.mlp).__name__ for layer in layers]
    assert len(set(kinds)) == 2 and len(layers) > 2, kinds
    keep = layers_of_each_kind(layers)
    assert [kinds[i] for i in keep] == list(dict.fromkeys(kinds))
    ran: dict[int, int] = {}

    def count(i: int):
        return lambda *_: ran.update({i: ran.get(i, 0) + 1})

    hooks = [layer.self_attn.register_forward_hook(count(i)) for i, layer in enumerate(layers)]
    try:
        warm_up(runner, max_len=32)
    finally:
        for hook in hooks:
            hook.remove()
    shapes = len(warmup_shapes(32, 2, 32))
    assert ran == {i: shapes for i in keep}
    assert list(runner.model.layers) == layers
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_an_engine_says_where_its_start_up_went(model_dir):
    # the phases, in order, each as long as the clock between its marks
    ticks = iter([0.0, 1.0, 3.5, 4.0])
    phases = StartupPhases(clock=lambda: next(ticks))
    phases.mark("weights")
    phases.mark("kv cache")
    phases.mark("weights")  # a phase met again adds up
    assert phases.seconds == {"weights": 1.5, "kv cache": 2.5}
    assert str(phases) == "4.0 s (weights 1.5 s, kv cache 2.5 s)"
    start = time.monotonic()
    llm = LLM(model_dir("tiny-llama"), device="cpu")
    took = time.monotonic() - start
    startup = llm.engine.startup
    assert list(startup.seconds)[:3] == ["config", "weights", "kv cache"]
    assert 0 < startup.total <= took


def test_the_host_tiers_memory_is_made_on_a_thread_of_its_own_and_taken_once(model_dir):
    from engine.config import EngineConfig
    from engine.host_memory_ahead import HostMemoryAhead

    caches = [torch.zeros(6, 2, 4, 3) for _ in range(3)]  # 3 layers of 6 blocks
    per_block = 3 * 2 * 4 * 3 * 4  # bytes of one block over the layers
    ahead = HostMemoryAhead(EngineConfig(device="cpu", host_kv_cache_gb=10 * per_block / 2**30))
    ahead.start(caches)
    assert ahead.started
    ahead.start(caches)  # once
    blocks, memory = ahead.take()
    assert blocks == 10 and memory.tensor.shape == (10, 3, 2, 4, 3)
    assert ahead.take() is None  # taken
    memory.close()
    off = HostMemoryAhead(EngineConfig(device="cpu", enable_prefix_caching=False))
    off.start(caches)
    assert not off.started and off.take() is None
    # an engine on the CPU takes its tier from it too (no warm-up there to overlap)
    llm = LLM(model_dir("tiny-llama"), device="cpu", dtype="float32", host_kv_cache_gb=0.01)
    host = llm.engine.tiers.host
    assert host is not None and host.blocks.shape[0] == host.pool.num_blocks
