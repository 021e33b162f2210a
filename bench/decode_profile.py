"""Where a decode step's time goes: the llama3-8b preset (bf16, dummy weights,
kernels and CUDA graphs) stepped under torch.profiler at batch 1 (128-token
context) and batch 64 (1k context).

For each batch: wall time per step, GPU kernel time per step (the sum of the
kernels' durations; wall minus that is time the GPU sat idle), the time per
step of each kernel family (matrix products, attention, norms, ...), the
bytes of weights read per step against the matrix products' time, and the
kernels that take the most time.

Usage: python -m bench.decode_profile --out DIR
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.ceilings import copy_bandwidth
from bench.engine_baseline import random_prompts
from engine import LLM, SamplingParams
from engine.make_model import preset_config, write_model

FAMILIES = (  # first match wins; names are lower-cased
    ("attention", ("attention", "_extend_kernel", "_decode_split", "_decode_reduce", "flash")),
    ("norm", ("rms", "norm")),
    ("rotary", ("rotary",)),
    ("silu_and_mul", ("silu",)),
    ("matmul", ("gemm", "gemv", "nvjet", "cutlass", "sm90", "xmma", "splitk")),
    ("sampling", ("argmax", "softmax", "topk", "sort", "multinomial")),
)


def family(name: str) -> str:
    low = name.lower()
    return next((f for f, keys in FAMILIES if any(k in low for k in keys)), "other")


def _start(llm: LLM, batch: int, context: int, steps: int) -> None:
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 16, temperature=0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for i, prompt in enumerate(random_prompts(batch, context, vocab, seed=batch)):
        engine.add_request(f"p-{batch}-{i}", prompt, params)
    while any(s.in_prefill for s in engine.scheduler.waiting + engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step(finished_only=True)


def profile_batch(llm: LLM, batch: int, context: int, steps: int = 32) -> dict:
    engine = llm.engine
    _start(llm, batch, context, steps * 2)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps // 2):
        engine.step(finished_only=True)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / (steps // 2) * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step(finished_only=True)
        torch.cuda.synchronize()
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            by_name[ev.name][0] += ev.device_time / 1e3 / steps  # ms per step
            by_name[ev.name][1] += 1 / steps
    families: dict[str, float] = defaultdict(float)
    for name, (ms, _) in by_name.items():
        families[family(name)] += ms
    kernel_ms = sum(families.values())
    weight_bytes = llm.engine.model_config.num_parameters() * 2
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:15]
    return {
        "batch": batch,
        "context": context,
        "wall_ms_per_step": wall_ms,
        "kernel_ms_per_step": kernel_ms,
        "idle_ms_per_step": wall_ms - kernel_ms,
        "kernels_per_step": sum(n for _, n in by_name.values()),
        "families_ms_per_step": dict(sorted(families.items(), key=lambda kv: -kv[1])),
        "matmul_weight_gbps": weight_bytes / (families["matmul"] / 1e3) / 1e9
        if families["matmul"]
        else None,
        "top_kernels": [
            {"name": n[:120], "ms_per_step": ms, "calls_per_step": c} for n, (ms, c) in top
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="llama3-8b")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = write_model(
        Path(tempfile.mkdtemp()) / args.preset, preset_config(args.preset), weights=False
    )
    copy_gbps = copy_bandwidth()
    llm = LLM(folder, dtype="bfloat16", device="cuda", load_format="dummy", max_num_seqs=64,
              max_num_batched_tokens=8192, max_model_len=4096)  # fmt: skip
    weight_bytes = llm.engine.model_config.num_parameters() * 2
    result = {
        "copy_gbps": copy_gbps,
        "weight_bytes": weight_bytes,
        "floor_ms_per_step_batch1": weight_bytes / (copy_gbps * 1e9) * 1e3,
        "runs": [profile_batch(llm, 1, 128), profile_batch(llm, 64, 1024)],
    }
    (out / "decode_profile.json").write_text(json.dumps(result, indent=2))
    print(f"copy {copy_gbps:.0f} GB/s; weights {weight_bytes / 1e9:.2f} GB; batch-1 floor "
          f"{result['floor_ms_per_step_batch1']:.2f} ms/step")  # fmt: skip
    for r in result["runs"]:
        fam = ", ".join(f"{k} {v:.2f}" for k, v in r["families_ms_per_step"].items())
        print(f"batch {r['batch']}: wall {r['wall_ms_per_step']:.2f} ms/step, kernels "
              f"{r['kernel_ms_per_step']:.2f} ms ({r['kernels_per_step']:.0f} launches), idle "
              f"{r['idle_ms_per_step']:.2f} ms; {fam}; matmuls read weights at "
              f"{r['matmul_weight_gbps'] or 0:.0f} GB/s")  # fmt: skip
        for k in r["top_kernels"][:6]:
            print(f"   {k['ms_per_step']:.3f} ms x{k['calls_per_step']:.0f}  {k['name'][:90]}")


if __name__ == "__main__":
    main()
