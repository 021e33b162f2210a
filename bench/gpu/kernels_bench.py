"""The kernels benchmark on one GPU, in one run: ceilings first, then every kernel
against its reference (time, GB/s or TFLOP/s, fraction of the ceiling, speed-up):
decode attention (kernels_attention), prefill attention and each of its variants
(kernels_prefill), the layer kernels (kernels_ops); and end-to-end decode of the
llama3-8b preset on kernels, graphs and async scheduling against the roofline and
the engine baseline (bench/results/engine_baseline.json). The engine's agreement
with its torch references is `engine_checks`.

Usage: python -m bench.gpu.kernels_bench --out bench/results/kernels_bench.json
           [--skip SECTION ...]
Sections: ceilings, decode_attention, prefill_attention, prefill_variants, ops,
rotary_configs, end_to_end. Prints a table last. The dry run (`--device cpu`) runs
the kernels under Triton's interpreter (TRITON_INTERPRET=1, as tests/conftest.py sets).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.gpu import ceilings, kernels_attention, kernels_ops, kernels_prefill
from bench.gpu.engine_rates import decode_rate, offline_throughput
from bench.gpu.models import preset_folder
from bench.gpu.sections import Sections, script_parser
from engine import LLM

BASELINE = Path(__file__).parents[1] / "results" / "engine_baseline.json"
# (preset, (batch, context, steps) per decode case, offline (prompts, input, output))
END_TO_END = {
    "cuda": ("llama3-8b", ((1, 128, 64), (64, 1024, 32)), (256, 1024, 128)),
    "cpu": ("tiny-llama", ((1, 16, 4), (4, 32, 4)), (4, 32, 8)),
}


def roofline_step_s(config, ceiling: dict, batch: int, context: int) -> float:
    """Lower bound of one decode step: weights + the batch's KV read once, or the FLOPs."""
    weight_bytes = config.num_parameters() * 2
    kv_per_token = 2 * config.num_key_value_heads * config.head_dim * 2 * config.num_hidden_layers
    bytes_moved = weight_bytes + batch * context * kv_per_token
    flops = 2 * config.num_parameters() * batch + batch * config.num_hidden_layers * (
        4 * context * config.num_attention_heads * config.head_dim
    )
    return max(
        bytes_moved / (ceiling["copy_gbps"] * 1e9), flops / (ceiling["matmul_bf16_tflops"] * 1e12)
    )


def end_to_end(section: Sections, ceiling: dict) -> dict:
    preset, cases, offline = END_TO_END[section.device]
    folder, load_format = preset_folder(section.tmp, preset)
    start = time.monotonic()
    llm = LLM(folder, dtype="bfloat16" if section.cuda else "float32", device=section.device,
              load_format=load_format, kernels="auto" if section.cuda else "torch",
              max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=8192)  # fmt: skip
    try:
        startup = time.monotonic() - start
        config = llm.engine.model_config
        floor_tps = ceiling["copy_gbps"] * 1e9 / (config.num_parameters() * 2)
        llm.engine.async_scheduling = True
        decode = [decode_rate(llm, *case) for case in cases]
        for d in decode:
            bound = roofline_step_s(config, ceiling, d["batch"], d["context"])
            d["roofline_step_ms"] = bound * 1e3
            d["step_over_roofline"] = d["step_ms"] / (bound * 1e3)
        decode[0]["fraction_of_bandwidth_floor"] = decode[0]["tokens_per_s"] / floor_tps
        # The same steps with async scheduling off: the host's share of a step.
        llm.engine.async_scheduling = False
        for d, case in zip(decode, cases):
            d["step_ms_without_async_scheduling"] = decode_rate(llm, *case)["step_ms"]
        llm.engine.async_scheduling = True
        result = {
            "preset": preset,
            "startup_s": startup,
            "batch1_bandwidth_floor_tokens_per_s": floor_tps,
            "decode": decode,
            "offline": offline_throughput(llm, *offline),
        }
    finally:
        llm.close()
    base = json.loads(BASELINE.read_text()) if BASELINE.is_file() else {}
    if base.get("model", "").startswith(preset):
        result["speedup_over_baseline"] = {
            "decode_batch1": decode[0]["tokens_per_s"] / base["decode"][0]["tokens_per_s"],
            "decode_batch64": decode[1]["tokens_per_s"] / base["decode"][1]["tokens_per_s"],
            "offline_output_tokens": result["offline"]["output_tokens_per_s"]
            / base["offline"]["output_tokens_per_s"],
        }
    return result


def main(argv: list[str] | None = None) -> dict:
    args = script_parser(__doc__).parse_args(argv)
    cuda = args.device == "cuda"
    attention = kernels_attention.GPU if cuda else kernels_attention.DRY
    ops = kernels_ops.GPU if cuda else kernels_ops.DRY
    with Sections(args, script="kernels_bench") as section:
        device = section.device
        ceiling = section("ceilings", lambda: ceilings.measure(device))
        section(
            "decode_attention",
            lambda: kernels_attention.run_decode(attention, ceiling["copy_gbps"], device),
        )
        prefill = section("prefill_attention", lambda: kernels_prefill.run_prefill(
            attention, ceiling["matmul_bf16_tflops"], device))  # fmt: skip
        sdpa = min((prefill or {}).get("sdpa_ms", {}).values(), default=None)
        section("prefill_variants", lambda: kernels_prefill.run_variants(attention, sdpa, device),
                needs="CUDA (the kernel tuner times candidates with CUDA events)")  # fmt: skip
        section("ops", lambda: kernels_ops.run(ops, ceiling, device))
        section("rotary_configs", lambda: kernels_ops.rotary_configs(ops, device),
                needs="CUDA (the kernel tuner times candidates with CUDA events)")  # fmt: skip
        section("end_to_end", lambda: end_to_end(section, ceiling))
        print_table(section.results)
        return section.results


def _times(x) -> str:
    return f"{x:.2f}x" if isinstance(x, int | float) else ""


def print_table(results: dict) -> None:
    c = results.get("ceilings") or {}
    if "copy_gbps" in c:
        print(f"\nceilings: copy {c['copy_gbps']:.0f} GB/s, bf16 matmul "
              f"{c['matmul_bf16_tflops']:.0f} TFLOP/s")  # fmt: skip
    print("| op | shape | ms | achieved | of ceiling | target | vs ref | vs sdpa | err |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name in ("decode_attention", "prefill_attention", "ops"):
        value = results.get(name)
        rows += value if isinstance(value, list) else [value]
    for row in rows:
        if not isinstance(row, dict) or "op" not in row:
            continue
        print(
            f"| {row['op']} | {row.get('shape')} | {row.get('ms', 0):.4f} | "
            f"{row.get('achieved', 0):.0f} {row.get('metric', '')} | "
            f"{row.get('fraction_of_ceiling', 0):.2f} | {row.get('target')} | "
            f"{row.get('speedup_vs_reference', 0):.1f}x | {_times(row.get('speedup_vs_sdpa'))} | "
            f"{row.get('max_rel_error', 0):.1e} |"
        )
    e2e = results.get("end_to_end") or {}
    for d in e2e.get("decode", []):
        floor = d.get("fraction_of_bandwidth_floor")
        print(
            f"decode batch {d['batch']} @ {d['context']}: {d['tokens_per_s']:.1f} tok/s, "
            f"{d['step_ms']:.2f} ms/step, {d['step_over_roofline']:.2f}x roofline"
            + (f", {floor:.2f} of the bandwidth floor" if floor is not None else "")
            + f" (async scheduling off: {d['step_ms_without_async_scheduling']:.2f} ms/step)"
        )
    if "offline" in e2e:
        o = e2e["offline"]
        print(f"offline {o['num_prompts']}x{o['input_len']}->{o['output_len']}: "
              f"{o['output_tokens_per_s']:.0f} out tok/s")  # fmt: skip
    if "speedup_over_baseline" in e2e:
        print(f"speed-up over baseline: {e2e['speedup_over_baseline']}")


if __name__ == "__main__":
    main()
