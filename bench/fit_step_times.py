"""Fits the mock runner's step time model (engine/step_time_model.py) to committed
H200 results and writes engine/device_profiles/h200.json:

- decode_profile.json (llama3-8b, kernel time by family for a decode step of 1
  row at 128 tokens and of 64 rows at 1,024): how fast the weights and the KV
  cache are read, the fixed cost of a step and the cost of each further row;
- kernels_bench.json: causal prompt attention's rate (8,192 tokens);
- kvstore_9a48538.json: an 8,192-token prompt recomputed through the mesh (its
  TTFT, less a short prompt's TTFT less one decode step: the mesh's own part);
- serving.json: 1,024-token prompts at its lightest load (4 req/s; TTFT p50 less
  the mesh's part and half a step): with the 8k prompt, a prompt's matmul rate
  and what a step with a prompt chunk costs beyond the roofline.

    python -m bench.fit_step_times [--out engine/device_profiles/h200.json]
Prints each fitted figure and what the fitted model gives back for each input."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from basis.model_config import ModelConfig
from engine.make_model import preset_config
from engine.step_time_model import PROFILES, DeviceProfile, ModelCosts, StepTimeModel

RESULTS = Path(__file__).parent / "results"
PRESET = "llama3-8b"
SERVING_PROMPT = 1024  # serving.py's prompts: 1024 tokens, generating 128


def _service_ms(decode: dict, kvstore: dict) -> float:
    """The services' own part of a request's TTFT on the H200's host (gateway,
    scheduler, worker, and back): a short prompt's TTFT through the mesh
    (kvstore_9a48538.json) less a one-row step (decode_profile.json)."""
    return kvstore["ttft_by_tier"]["short_prompt_ms"] - _run(decode, 1)["wall_ms_per_step"]


def _run(decode: dict, batch: int) -> dict:
    return next(r for r in decode["runs"] if r["batch"] == batch)


def _solve(below, lo: float, hi: float) -> float:
    """The x in [lo, hi] where `below(x)` turns false (bisection; true for x below it)."""
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if below(mid) else (lo, mid)
    return (lo + hi) / 2


def fit(results: Path = RESULTS) -> tuple[DeviceProfile, dict]:
    costs = ModelCosts.of(ModelConfig.from_dict(preset_config(PRESET)))
    decode = json.loads((results / "decode_profile.json").read_text())
    kernels = json.loads((results / "kernels_bench.json").read_text())
    kvstore = json.loads((results / "kvstore_9a48538.json").read_text())
    serving = json.loads((results / "serving.json").read_text())
    copy = decode["copy_gbps"] * 1e9
    tflops = kernels["ceilings"]["matmul_bf16_tflops"]
    one, many = _run(decode, 1), _run(decode, 64)

    def kv_read(run):
        return run["batch"] * (run["context"] + 1) * costs.kv_bytes_per_token

    # the weights: a one-row step's matmuls are the weights read once
    weight_eff = costs.weight_bytes / (copy * one["families_ms_per_step"]["matmul"] / 1e3)
    # the KV cache: what 64 rows' attention adds over one row's
    attn = many["families_ms_per_step"]["attention"] - one["families_ms_per_step"]["attention"]
    kv_eff = (kv_read(many) - kv_read(one)) / (copy * attn / 1e3)
    # each further row: the rest of the step beyond attention, over 63 rows
    rest = [r["kernel_ms_per_step"] - r["families_ms_per_step"]["attention"] for r in (one, many)]
    per_row_us = (rest[1] - rest[0]) / (many["batch"] - one["batch"]) * 1e3
    # a one-row step less its weights and its KV: launches, norms, sampling; its
    # host's share (wall over kernel time) too
    fixed_ms = one["wall_ms_per_step"] - one["families_ms_per_step"]["matmul"] - per_row_us / 1e3
    fixed_ms -= kv_read(one) / (copy * kv_eff) * 1e3
    extend = next(a for a in kernels["attention"] if a["op"].startswith("extend_attention"))
    attention_eff = extend["achieved"] / tflops
    tier = kvstore["ttft_by_tier"]
    tokens = tier["prompt_tokens"]
    mesh_ms = _service_ms(decode, kvstore)
    prompt_ms = tier["none"]["ttft_ms"] - mesh_ms
    # a 1,024-token prompt: the lightest load a committed serving run has (serving.json,
    # 4 req/s), its TTFT p50 less the mesh's part and half a one-row step (the step in
    # flight when a request comes)
    light = min(serving["serve"]["sweep"], key=lambda r: float(r["request_rate"]))
    short_tokens = SERVING_PROMPT
    short_ms = light["median_ttft_ms"] - mesh_ms - one["wall_ms_per_step"] / 2
    profile = DeviceProfile(
        name="h200", copy_gbps=decode["copy_gbps"], matmul_tflops=tflops,
        weight_efficiency=weight_eff, kv_efficiency=kv_eff, matmul_efficiency=1.0,
        prompt_step_ms=0.0, service_ms=mesh_ms,
        attention_efficiency=attention_eff, fixed_ms=fixed_ms, per_row_us=per_row_us,
        source="bench/fit_step_times.py: decode_profile.json, kernels_bench.json, "
        "kvstore_9a48538.json, serving.json",
    )  # fmt: skip

    # a prompt's matmul rate and what a step with a prompt chunk costs beyond the
    # roofline: the pair that gives both prompts' measured times (a prompt's time
    # falls as the rate rises and rises with the step's extra)
    def prompt_ms_at(tokens: int, **fitted) -> float:
        return StepTimeModel(costs, replace(profile, **fitted)).seconds([(tokens, 0)]) * 1e3

    def fitted_rate(extra_ms: float) -> dict:
        def slow(e):
            return prompt_ms_at(tokens, matmul_efficiency=e, prompt_step_ms=extra_ms) > prompt_ms

        return {"matmul_efficiency": _solve(slow, 0.05, 2.0), "prompt_step_ms": extra_ms}

    extra = _solve(
        lambda x: prompt_ms_at(short_tokens, **fitted_rate(x)) <= short_ms, 0.0, short_ms
    )
    profile = replace(profile, **fitted_rate(extra))
    model = StepTimeModel(costs, profile)
    check = {
        "decode 1 row at 128: wall ms": (one["wall_ms_per_step"], _ms(model, one)),
        "decode 64 rows at 1024: wall ms": (many["wall_ms_per_step"], _ms(model, many)),
        f"prompt of {tokens}: ms (TTFT less the mesh's {mesh_ms:.1f})": (
            prompt_ms,
            model.seconds([(tokens, 0)]) * 1e3,
        ),
        f"prompt of {short_tokens}: ms (serving.json's TTFT p50 at {light['request_rate']} "
        "req/s, less the mesh's part and half a step)": (
            short_ms,
            model.seconds([(short_tokens, 0)]) * 1e3,
        ),
    }
    return profile, check


def _ms(model: StepTimeModel, run: dict) -> float:
    return model.seconds([(1, run["context"])] * run["batch"]) * 1e3


def main(argv: list[str] | None = None) -> DeviceProfile:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=PROFILES / "h200.json")
    args = parser.parse_args(argv)
    profile, check = fit()
    for key, value in profile.__dict__.items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    for what, (measured, modelled) in check.items():
        print(f"{what}: measured {measured:.2f}, modelled {modelled:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(profile.to_json())
    print(f"wrote {args.out}")
    return profile


if __name__ == "__main__":
    main()
