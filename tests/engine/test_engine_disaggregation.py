"""Prefill on one engine, decode on another: the KV handed over layer by
layer, only the blocks the decode side lacks, and the same tokens as one
engine doing both. Leases hold the prefill side's blocks until released."""

from __future__ import annotations

import time

import pytest
import torch
from prompts import random_prompts

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.disaggregation import Handoff

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


class CopyHandoff(Handoff):
    """Copies each layer's blocks straight into the decode engine's cache."""

    def __init__(self, decode: LLMEngine, dst_ids: list[int], skip_blocks: int):
        super().__init__(skip_blocks)
        self.decode, self.dst = decode, torch.tensor(dst_ids)
        self.layers: list[int] = []

    def start(self, src_block_ids):
        assert len(src_block_ids) == len(self.dst)
        self.src = torch.tensor(src_block_ids)

    def send_layer(self, layer, cache_layer):
        self.layers.append(layer)
        self.decode.runner.kv_caches[layer][self.dst] = cache_layer[self.src]


def run_until_done(engine: LLMEngine, request_id: str):
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out


def handoff(prefill: LLMEngine, decode: LLMEngine, request_id: str, prompt, params=PARAMS):
    res = decode.reserve_remote(decode.make_request(request_id, prompt, params))
    assert res is not None
    h = CopyHandoff(decode, res.dst_block_ids, res.skip_blocks)
    prefill.add_request(request_id, prompt, params.clone(max_tokens=1), handoff=h, hold_seconds=30)
    first = run_until_done(prefill, request_id)
    assert h.layers == list(range(prefill.model_config.num_hidden_layers))
    decode.commit_remote(request_id, first.outputs[0].token_ids[0])
    return res, run_until_done(decode, request_id)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-v3"])  # K/V and latent caches
def test_split_engines_equal_one_engine(model_dir, name):
    folder = model_dir(name)
    cfg = dict(dtype="float32", device="cpu", max_prefill_chunk=48)
    prefill, decode = LLMEngine(folder, EngineConfig(**cfg)), LLMEngine(folder, EngineConfig(**cfg))
    prompts = random_prompts(500, (1, 16, 17, 100, 333), seed=81)
    expected = LLM(folder, **cfg).generate(prompts, PARAMS)
    for i, (prompt, exp) in enumerate(zip(prompts, expected)):
        res, out = handoff(prefill, decode, f"r{i}", prompt)
        assert out.outputs[0].token_ids == exp.outputs[0].token_ids, len(prompt)
        assert f"r{i}" in prefill.disagg.held  # blocks stay until the decode side says
        assert prefill.release_held(f"r{i}")
    assert prefill.get_stats()["kv_blocks_used"] == 0
    assert decode.get_stats()["kv_blocks_used"] == 0


def test_only_missing_blocks_move(model_dir):
    folder = model_dir("tiny-qwen3")
    cfg = dict(dtype="float32", device="cpu")
    prefill, decode = LLMEngine(folder, EngineConfig(**cfg)), LLMEngine(folder, EngineConfig(**cfg))
    prefix, a, b = random_prompts(500, (160, 20, 30), seed=82)
    first, _ = handoff(prefill, decode, "a", prefix + a)
    assert first.skip_blocks == 0
    second, out = handoff(prefill, decode, "b", prefix + b)
    assert second.skip_blocks == 10  # 160 shared tokens = 10 blocks already on the decode side
    assert len(second.dst_block_ids) == -(-190 // 16) - 10
    expected = LLM(folder, **cfg).generate([prefix + b], PARAMS)[0]
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids


def test_leases_expire_and_reservations_cancel(model_dir):
    folder = model_dir("tiny-llama")
    cfg = EngineConfig(dtype="float32", device="cpu")
    prefill, decode = LLMEngine(folder, cfg), LLMEngine(folder, cfg)
    prompt = random_prompts(500, (40,), seed=83)[0]
    res = decode.reserve_remote(decode.make_request("x", prompt, PARAMS))
    prefill.add_request(
        "x",
        prompt,
        PARAMS.clone(max_tokens=1),
        handoff=CopyHandoff(decode, res.dst_block_ids, 0),
        hold_seconds=0.05,
    )
    run_until_done(prefill, "x")
    assert prefill.get_stats()["kv_blocks_used"] > 0
    time.sleep(0.1)
    assert prefill.expire_held() == ["x"]
    assert prefill.get_stats()["kv_blocks_used"] == 0
    assert decode.abort_request("x") is None  # a reservation is dropped, its blocks freed
    assert decode.get_stats()["kv_blocks_used"] == 0 and not decode.requests
