"""The mock runner's fitted GPU timing (engine/step_time_model.py): the committed
profile is what the fit gives from the committed results, the model gives those
results back, and a mock engine takes its steps' modelled time, scaled."""

from __future__ import annotations

import json
import time

import pytest

from basis.model_config import ModelConfig
from bench.fit_step_times import fit
from engine import LLM, SamplingParams
from engine.make_model import preset_config
from engine.step_time_model import PROFILES, DeviceProfile, ModelCosts, StepTimeModel

LLAMA3_8B = ModelConfig.from_dict(preset_config("llama3-8b"))


def test_the_committed_h200_profile_is_the_fit_of_the_committed_results():
    profile, check = fit()
    committed = json.loads((PROFILES / "h200.json").read_text())
    for key, value in profile.__dict__.items():
        if isinstance(value, str):  # approx takes numbers only (pytest 9.2 raises on a str)
            assert committed[key] == value, key
        else:
            assert committed[key] == pytest.approx(value, rel=1e-9), key
    for what, (measured, modelled) in check.items():  # each input given back
        assert modelled == pytest.approx(measured, rel=0.02), what


def test_llama3_8b_on_the_h200_profile_costs_what_its_shape_says():
    costs = ModelCosts.of(LLAMA3_8B)
    assert costs.kv_bytes_per_token == 131072  # 32 layers x K and V x 8 heads x 128 x bf16
    assert 14.9e9 < costs.weight_bytes < 15.1e9  # 8.0B weights less the input embedding
    h200 = DeviceProfile.load("h200")
    model = StepTimeModel(costs, h200)
    copy = h200.copy_gbps * 1e9
    one = model.seconds([(1, 128)])
    # a decode step is the weights' read and a fixed part; 64 rows of 1,024 tokens add
    # their KV's read and a part for each row
    read = costs.weight_bytes / (copy * h200.weight_efficiency)
    assert one == pytest.approx(read + (h200.fixed_ms + h200.per_row_us / 1e3) / 1e3, rel=0.01)
    many = model.seconds([(1, 1024)] * 64)
    kv = (64 * 1025 - 129) * 131072 / (copy * h200.kv_efficiency)
    assert many - one == pytest.approx(kv + 63 * h200.per_row_us / 1e6, rel=0.01)
    # a prompt is compute: 1,024 more tokens cost their matmuls and the attention's
    # growth with the square of the length
    rate = h200.matmul_tflops * 1e12

    def attention(n):
        return n * (n + 1) / 2 * costs.attention_flops / (rate * h200.attention_efficiency)

    more = 1024 * costs.flops_per_token / (rate * h200.matmul_efficiency)
    more += attention(2048) - attention(1024)
    assert model.seconds([(2048, 0)]) - model.seconds([(1024, 0)]) == pytest.approx(more)
    assert model.seconds([(1024, 4096)]) > model.seconds([(1024, 0)])
    assert model.seconds([]) == 0.0


def test_the_model_refuses_moe_and_mla_configs_and_unknown_devices(model_dir):
    for preset in ("tiny-moe", "tiny-deepseek-v2"):
        with pytest.raises(ValueError, match="dense models"):
            ModelCosts.of(ModelConfig.from_pretrained(model_dir(preset)))
        with pytest.raises(ValueError, match="dense models"):
            LLM(model_dir(preset), model_runner="mock", mock_device="h200")
    with pytest.raises(ValueError, match="no device profile 'a100'; known: h200"):
        DeviceProfile.load("a100")
    with pytest.raises(ValueError, match="mock_device 'a100' is not a profile; known: h200"):
        LLM(model_dir("tiny-llama"), model_runner="mock", mock_device="a100")
    with pytest.raises(ValueError, match="mock_time_scale must be > 0"):
        LLM(model_dir("tiny-llama"), model_runner="mock", mock_time_scale=0)


@pytest.mark.alone  # each step within a second of its modelled time
def test_a_mock_engine_on_a_device_profile_takes_each_steps_modelled_time_scaled(model_dir):
    llm = LLM(model_dir("tiny-llama"), model_runner="mock", mock_device="h200",
              mock_time_scale=100.0)  # fmt: skip
    runner = llm.engine.runner
    costs = ModelCosts.of(runner.model_config)
    model = StepTimeModel(costs, DeviceProfile.load("h200"))
    # tiny-llama on an H200: ~14 ms for the prompt's step, ~0.6 for a decode; 100 times
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    start = time.monotonic()
    out = llm.generate([[5, 6, 7, 8, 9]], params)[0]
    took = time.monotonic() - start
    steps = [[(5, 0)], [(1, 5)], [(1, 6)]]  # the prompt, then two decodes
    modelled = sum(model.seconds(rows) for rows in steps) * 100.0
    assert len(out.outputs[0].token_ids) == 3
    assert modelled <= took < modelled + 1.0


def test_a_mock_on_a_gpu_profile_queues_steps_ahead_and_answers_as_the_plain_mock(model_dir):
    """On a device profile the engine queues each step before reading the last one
    back, as on the GPU; the answers are the plain (synchronous) mock's."""
    folder = model_dir("tiny-llama")
    prompts = [[3 + i, 40 + i, 7, 9 + 2 * i, 11] for i in range(12)]
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    plain = LLM(folder, model_runner="mock", mock_step_ms=0, mock_token_us=0)
    gpu = LLM(folder, model_runner="mock", mock_device="h200", mock_time_scale=0.2)
    assert not plain.engine.async_scheduling and gpu.engine.async_scheduling
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, params)] == want
    sampled = SamplingParams(max_tokens=9, temperature=1.0, seed=5, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sampled)]
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, sampled)] == want


@pytest.mark.alone  # its bounds need the machine's cores
def test_the_step_time_check_runs_a_mock_mesh_on_the_profile(tmp_path):
    """A bounded slice of bench/step_time_check.py: three short requests through a mesh
    whose worker is the mock on llama3-8b's H200 profile, set beside the committed
    run; its first token comes no sooner than the profile's step for the prompt, the
    others not at twice its one-row decode step's pace."""
    from bench.step_time_check import main

    out = tmp_path / "check.json"
    result = main(["--out", str(out), "--rates", "16", "--prompts-per-rate", "3", "--scale", "1",
                   "--input-len", "64", "--output-len", "4"])  # fmt: skip
    assert json.loads(out.read_text()) == result
    row = result["rows"][0]
    assert (row["completed"], row["failed"], result["rc"]) == (3, 0, 0)
    assert row["measured"]["runs"] == 2  # the committed run's two default meshes at 16 req/s
    assert row["measured"]["median_tpot_ms"] == pytest.approx((8.40 + 8.55) / 2, abs=0.01)
    model = StepTimeModel(ModelCosts.of(LLAMA3_8B), DeviceProfile.load("h200"))
    assert row["simulated"]["median_ttft_ms"] >= model.seconds([(64, 0)]) * 1e3  # ~18 ms
    # (a first token that reached the client late shortens the rest's mean gap: half)
    assert row["simulated"]["median_tpot_ms"] >= 0.5 * model.seconds([(1, 64)]) * 1e3
    assert row["ratio"]["median_tpot_ms"] == pytest.approx(
        row["simulated"]["median_tpot_ms"] / row["measured"]["median_tpot_ms"]
    )
    # the H200 host's services (5.3 ms: a short prompt's TTFT there less a step) apart
    assert result["gpu_service_ms"] == pytest.approx(9.774 - 4.483, abs=0.01)
    served = row["simulated_with_service"]["median_ttft_ms"]
    assert served == pytest.approx(row["simulated"]["median_ttft_ms"] + result["gpu_service_ms"])
