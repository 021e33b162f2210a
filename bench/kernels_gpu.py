"""The kernels benchmark on one GPU, in one run: ceilings first, then every
kernel against its reference (time, GB/s or TFLOP/s, fraction of the ceiling,
speed-up), and end-to-end decode of the llama3-8b preset against the roofline
and the engine baseline. (The engine's agreement with its torch references is
bench/engine_checks_gpu.py.)

Usage: python -m bench.kernels_gpu --out DIR [--skip SECTION ...]
Writes DIR/kernels.json after every section and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench.ceilings import measure
from bench.engine_baseline import decode_rate, offline_throughput
from bench.sections import Sections
from engine import LLM
from engine.make_model import preset_config, write_model

BASELINE = Path(__file__).parent / "results" / "engine_baseline.json"


def roofline_step_s(config, ceilings: dict, batch: int, context: int) -> float:
    """Lower bound of one decode step: weights + the batch's KV read once, or the FLOPs."""
    weight_bytes = config.num_parameters() * 2
    kv_per_token = 2 * config.num_key_value_heads * config.head_dim * 2 * config.num_hidden_layers
    bytes_moved = weight_bytes + batch * context * kv_per_token
    flops = 2 * config.num_parameters() * batch + batch * config.num_hidden_layers * (
        4 * context * config.num_attention_heads * config.head_dim
    )
    return max(
        bytes_moved / (ceilings["copy_gbps"] * 1e9), flops / (ceilings["matmul_bf16_tflops"] * 1e12)
    )


def end_to_end(tmp: Path, ceilings: dict) -> dict:
    folder = write_model(tmp / "llama3-8b-e2e", preset_config("llama3-8b"), weights=False)
    start = time.monotonic()
    llm = LLM(
        folder,
        dtype="bfloat16",
        device="cuda",
        load_format="dummy",
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=8192,
    )
    startup = time.monotonic() - start
    config = llm.engine.model_config
    floor_tps = ceilings["copy_gbps"] * 1e9 / (config.num_parameters() * 2)
    decode = [decode_rate(llm, 1, 128, 64), decode_rate(llm, 64, 1024, 32)]
    for d in decode:
        bound = roofline_step_s(config, ceilings, d["batch"], d["context"])
        d["roofline_step_ms"] = bound * 1e3
        d["step_over_roofline"] = d["step_ms"] / (bound * 1e3)
    decode[0]["fraction_of_bandwidth_floor"] = decode[0]["tokens_per_s"] / floor_tps
    # The same steps with async scheduling off: the host's share of a step.
    llm.engine.async_scheduling = False
    sync = [decode_rate(llm, 1, 128, 64), decode_rate(llm, 64, 1024, 32)]
    llm.engine.async_scheduling = True
    for d, plain in zip(decode, sync):
        d["step_ms_without_async_scheduling"] = plain["step_ms"]
    offline = offline_throughput(llm, 256, 1024, 128)
    result = {
        "startup_s": startup,
        "batch1_bandwidth_floor_tokens_per_s": floor_tps,
        "decode": decode,
        "offline": offline,
    }
    if BASELINE.is_file():
        base = json.loads(BASELINE.read_text())
        result["speedup_over_baseline"] = {
            "decode_batch1": decode[0]["tokens_per_s"] / base["decode"][0]["tokens_per_s"],
            "decode_batch64": decode[1]["tokens_per_s"] / base["decode"][1]["tokens_per_s"],
            "offline_output_tokens": offline["output_tokens_per_s"]
            / base["offline"]["output_tokens_per_s"],
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip", nargs="*", default=[])
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp())
    ceilings = measure()
    results: dict = {"ceilings": ceilings}

    section = Sections(results, out / "kernels.json", args.skip)

    from bench import kernels_attention, kernels_ops

    section("attention", lambda: kernels_attention.run(ceilings))
    section("ops", lambda: kernels_ops.run(ceilings))
    section("end_to_end", lambda: end_to_end(tmp, ceilings))
    print_table(results)


def _times(x) -> str:
    return f"{x:.2f}x" if isinstance(x, int | float) else ""


def print_table(results: dict) -> None:
    c = results["ceilings"]
    print(
        f"\nceilings: copy {c['copy_gbps']:.0f} GB/s, bf16 matmul "
        f"{c['matmul_bf16_tflops']:.0f} TFLOP/s"
    )
    print("| op | shape | ms | achieved | of ceiling | target | vs ref | vs sdpa | err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in list(results.get("attention") or []) + list(results.get("ops") or []):
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
            + f" (async scheduling off: {d.get('step_ms_without_async_scheduling', 0):.2f} "
            "ms/step)"
        )
    if "offline" in e2e:
        o = e2e["offline"]
        print(f"offline 256x1024->128: {o['output_tokens_per_s']:.0f} out tok/s")
    if "speedup_over_baseline" in e2e:
        print(f"speed-up over baseline: {e2e['speedup_over_baseline']}")


if __name__ == "__main__":
    main()
