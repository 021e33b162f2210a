"""Where a decode step's time goes: the llama3-8b preset (bf16, dummy weights,
kernels and CUDA graphs) stepped under torch.profiler at batch 1 (128-token
context) and batch 64 (1k context).

For each batch: wall time per step, GPU kernel time per step (the sum of the
kernels' durations; wall minus that is time the GPU sat idle), the time per
step of each kernel family (matrix products, attention, norms, experts, ...),
the bytes of weights a token reads (a mixture of experts: its top-k) against the
time of the kernels that read them, the step against its roofline bound (the weights
and every sequence's KV read once, over the copy bandwidth: `step_over_bound`), and
the kernels that take the most time.

Usage: python -m bench.gpu.decode_profile --out bench/results/decode_profile.json
           [--preset NAME]
Sections: ceilings, model, batch_<n> per batch. The dry run (`--device cpu`) profiles
the CPU's operators (their own time, so nested operators count once) instead.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench.gpu.ceilings import copy_bandwidth
from bench.gpu.engine_rates import abort_all, start_decode, sync
from bench.gpu.models import preset_folder
from bench.gpu.sections import Sections, script_parser
from engine import LLM

# (preset, (batch, context) per profile, steps profiled)
GPU = ("llama3-8b", ((1, 128), (64, 1024)), 32)
DRY = ("tiny-llama", ((1, 16), (4, 32)), 4)
FAMILIES = (  # first match wins; names are lower-cased
    ("attention", ("attention", "_extend_kernel", "_decode_split", "_decode_reduce", "flash")),
    ("norm", ("rms", "norm")),
    ("rotary", ("rotary",)),
    ("silu_and_mul", ("silu",)),
    ("matmul", ("gemm", "gemv", "nvjet", "cutlass", "sm90", "xmma", "splitk")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm")),  # the CPU's operators
    # the experts' kernels (kernels/fused_moe.py, moe_routing.py, grouped_topk.py)
    (
        "moe",
        (
            "_gate_up_kernel",
            "_down_kernel",
            "_route_kernel",
            "_count_kernel",
            "_scan_kernel",
            "_scatter_kernel",
            "_align_one_program",
            "grouped_topk",
            "moe",
        ),
    ),
    ("sampling", ("argmax", "softmax", "topk", "sort", "multinomial")),
)


def family(name: str) -> str:
    low = name.lower()
    return next((f for f, keys in FAMILIES if any(k in low for k in keys)), "other")


def kernel_times(prof, cuda: bool) -> dict[str, list[float]]:
    """name -> [total ms, calls] of the GPU kernels (on the CPU: operators' own time)."""
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if cuda and ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            us = ev.device_time
        elif not cuda and ev.self_cpu_time_total > 0:
            us = ev.self_cpu_time_total
        else:
            continue
        by_name[ev.name][0] += us / 1e3
        by_name[ev.name][1] += 1
    return by_name


def family_times(by_name: dict) -> dict[str, float]:
    """family -> total ms of the kernels (`kernel_times`' name -> (ms, calls)) in it."""
    families: dict[str, float] = defaultdict(float)
    for name, (ms, _) in by_name.items():
        families[family(name)] += ms
    return families


def profile_batch(llm: LLM, batch: int, context: int, steps: int) -> dict:
    engine, cuda = llm.engine, llm.engine.facts.device.type == "cuda"
    start_decode(llm, batch, context, steps * 2)
    sync(llm)
    start = time.perf_counter()
    for _ in range(steps // 2):
        engine.step(finished_only=True)
    sync(llm)
    wall_ms = (time.perf_counter() - start) / (steps // 2) * 1e3
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step(finished_only=True)
        sync(llm)
    abort_all(llm)
    by_name = {
        n: (ms / steps, calls / steps) for n, (ms, calls) in kernel_times(prof, cuda).items()
    }
    families = family_times(by_name)
    kernel_ms = sum(families.values())
    # the weights a token reads (a mixture of experts: its top-k; a batch reads more of them,
    # so there this understates), over the kernels reading them
    weight_bytes = engine.model_config.active_parameters() * 2
    weight_ms = families["matmul"] + families.get("moe", 0.0)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:15]
    return {
        "batch": batch,
        "context": context,
        "wall_ms_per_step": wall_ms,
        "kernel_ms_per_step": kernel_ms,
        "idle_ms_per_step": wall_ms - kernel_ms,
        "kernels_per_step": sum(n for _, n in by_name.values()),
        "families_ms_per_step": dict(sorted(families.items(), key=lambda kv: -kv[1])),
        "matmul_weight_gbps": weight_bytes / (weight_ms / 1e3) / 1e9 if weight_ms else None,
        "top_kernels": [
            {"name": n[:120], "ms_per_step": ms, "calls_per_step": c} for n, (ms, c) in top
        ],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--preset")
    args = parser.parse_args(argv)
    preset, batches, steps = GPU if args.device == "cuda" else DRY
    preset = args.preset or preset
    with Sections(args, script="decode_profile", preset=preset) as section:
        small = 1 << 20  # the dry run's copy
        copy = section("ceilings", lambda: {"copy_gbps": copy_bandwidth(
            4 << 30 if section.cuda else small, section.device)})  # fmt: skip

        def make() -> LLM:
            folder, load_format = preset_folder(section.tmp, preset)
            # No prefill warm-up: only decode steps are profiled (the graph capture tunes them).
            return LLM(folder, dtype="bfloat16", device=section.device, load_format=load_format,
                       kernels="auto" if section.cuda else "torch", max_num_seqs=64,
                       max_num_batched_tokens=8192, max_model_len=4096,
                       warmup=False)  # fmt: skip

        llm = section.resource(make, LLM.close)

        def model() -> dict:
            config = llm().engine.model_config
            # a mixture of experts reads its active weights a token (its top-k experts)
            weight_bytes = config.active_parameters() * 2
            floor = weight_bytes / (copy["copy_gbps"] * 1e9) * 1e3
            return {"weight_bytes": weight_bytes, "floor_ms_per_step_batch1": floor}

        weights = section("model", model)

        def batch_section(batch: int, context: int) -> dict:
            out = profile_batch(llm(), batch, context, steps)
            if weights and copy:  # the step's roofline: every weight and each sequence's KV read
                kv = batch * context * llm().engine.runner.kv_spec.bytes_per_token
                bound = (weights["weight_bytes"] + kv) / (copy["copy_gbps"] * 1e9) * 1e3
                out |= {"kv_bytes_read": kv, "bound_ms_per_step": bound,
                        "step_over_bound": out["wall_ms_per_step"] / bound}  # fmt: skip
            return out

        for batch, context in batches:
            section(f"batch_{batch}", lambda b=batch, c=context: batch_section(b, c))
        print_summary(section.results)
        return section.results


def print_summary(results: dict) -> None:
    for name, r in results.items():
        if not (name.startswith("batch_") and isinstance(r, dict) and "batch" in r):
            continue
        fam = ", ".join(f"{k} {v:.2f}" for k, v in r["families_ms_per_step"].items())
        print(f"batch {r['batch']}: wall {r['wall_ms_per_step']:.2f} ms/step, kernels "
              f"{r['kernel_ms_per_step']:.2f} ms ({r['kernels_per_step']:.0f} launches), idle "
              f"{r['idle_ms_per_step']:.2f} ms; {fam}; matmuls read weights at "
              f"{r['matmul_weight_gbps'] or 0:.0f} GB/s; {r.get('step_over_bound', 0):.2f}x the "
              f"bound of its weight and KV reads")  # fmt: skip
        for k in r["top_kernels"][:12]:
            print(f"   {k['ms_per_step']:.3f} ms x{k['calls_per_step']:.0f}  {k['name'][:90]}")


if __name__ == "__main__":
    main()
