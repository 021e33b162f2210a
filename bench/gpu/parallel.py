"""Tensor and pipeline parallelism inside one worker: greedy outputs of every
parallel size equal one process's (float32, every tiny preset, with prefix hits,
chunked prefill and preemption), then, on several GPUs, the speed: decode step
time at batch 1 and 64 (1k context) and an 8k-token prefill at TP 1, 2, 4
(scaling efficiency = speed-up / GPUs, and the collectives' share of the step),
and offline throughput (1000 x 1024 -> 128) with PP 2 against TP 2 and against
two data-parallel replicas on the same GPUs (with each stage's bubble).

Usage: python -m bench.gpu.parallel --out bench/results/parallel.json [--skip ...]
           [--device cpu]
Sections: ceilings, equality, tp_scaling, pp_throughput. With `--device cpu` the
equality matrix runs on gloo (the slice tests/engine/test_parallel.py runs, and more);
the speed sections need 2 or 4 GPUs and say so when they are not there.
"""

from __future__ import annotations

import time

import torch

from bench.gpu import ceilings
from bench.gpu.engine_rates import decode_rate, offline_throughput, random_prompts
from bench.gpu.models import preset_folder
from bench.gpu.sections import Sections, script_parser
from engine import LLM, SamplingParams
from engine.make_model import TINY_PRESETS, preset_config, write_model

SIZES = ((2, 1), (4, 1), (1, 2), (1, 3), (2, 2))  # (tensor, pipeline)
DEEPER = ("tiny-llama@4", "tiny-qwen3@4")  # 2-layer presets made deep enough for PP 3
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _config(name: str) -> dict:
    """A preset's config; "preset@N" is the preset with N layers (the 2-layer presets
    cannot be split into 3 stages)."""
    preset, _, layers = name.partition("@")
    config = preset_config(preset)
    return config | {"num_hidden_layers": int(layers)} if layers else config


def _folder(root, name: str):
    if "@" not in name:
        return preset_folder(root, name)[0]
    folder = root / name.replace("@", "-layers-")
    if not (folder / "config.json").is_file():
        write_model(folder, _config(name), seed=1)
    return folder


def _fits(name: str, tp: int, pp: int) -> bool:
    config = _config(name)
    return config["num_attention_heads"] % tp == 0 and config["num_hidden_layers"] >= pp


def equality(root, device: str, presets=TINY_PRESETS, sizes=SIZES) -> dict:
    """Greedy outputs of each (tp, pp) against one process, per preset."""
    gpus = torch.cuda.device_count() if device == "cuda" else 64
    shared = random_prompts(1, 40, 500, seed=1)[0]
    prompts = [shared + tail for tail in random_prompts(4, 30, 500, seed=2)]
    options = dict(device=device, dtype="float32", max_prefill_chunk=7, num_gpu_blocks=16)
    out = {}
    for preset in presets:
        folder = _folder(root, preset)

        def run(folder=folder, **sizes) -> list[list[int]]:
            llm = LLM(folder, **options, **sizes)
            try:
                outs = llm.generate(prompts[:1], GREEDY) + llm.generate(prompts[1:], GREEDY)
                return [o.outputs[0].token_ids for o in outs]
            finally:
                llm.close()

        want = run()
        for tp, pp in sizes:
            key = f"{preset}/tp{tp}-pp{pp}"
            if not _fits(preset, tp, pp) or tp * pp > gpus:
                out[key] = {"skipped": "the model or the machine has too few heads, "
                            "layers or GPUs"}  # fmt: skip
                continue
            out[key] = {"equal": run(tensor_parallel_size=tp, pipeline_parallel_size=pp) == want}
    out["all_equal"] = all(v.get("equal", True) for v in out.values() if isinstance(v, dict))
    return out


def tp_scaling(root, preset: str, gpus: int) -> dict:
    folder, load = preset_folder(root, preset)
    rows = {}
    for tp in (1, 2, 4):
        if tp > gpus:
            continue
        llm = LLM(folder, dtype="bfloat16", load_format=load, tensor_parallel_size=tp,
                  max_model_len=9216, max_num_seqs=64)  # fmt: skip
        try:
            row = {"batch_1": decode_rate(llm, 1, 1024, 32),
                   "batch_64": decode_rate(llm, 64, 1024, 32)}  # fmt: skip
            start = time.perf_counter()
            llm.generate(random_prompts(1, 8192, 1000, seed=3), SamplingParams(max_tokens=1))
            row["prefill_8k_ms"] = (time.perf_counter() - start) * 1e3
            stats = llm.engine.runner.parallel_stats()
            row["collective_share"] = sum(r["collective_seconds"] for r in stats) / max(
                1e-9, sum(r["busy_seconds"] for r in stats)
            )
        finally:
            llm.close()
        rows[f"tp{tp}"] = row
    base = rows["tp1"]["batch_64"]["tokens_per_s"]
    for tp, row in rows.items():
        n = int(tp[2:])
        row["scaling_efficiency_batch_64"] = row["batch_64"]["tokens_per_s"] / base / n
    return rows


def pp_throughput(root, preset: str) -> dict:
    folder, load = preset_folder(root, preset)
    out = {}
    for name, sizes in (("pp2", {"pipeline_parallel_size": 2}),
                        ("tp2", {"tensor_parallel_size": 2})):  # fmt: skip
        llm = LLM(folder, dtype="bfloat16", load_format=load, **sizes)
        try:
            before = llm.engine.runner.parallel_stats()
            out[name] = offline_throughput(llm, 1000, 1024, 128)
            after = llm.engine.runner.parallel_stats()
            wall = out[name]["elapsed_s"]
            out[name]["busy_fraction"] = [
                (a["busy_seconds"] - b["busy_seconds"]) / wall for a, b in zip(after, before)
            ]
        finally:
            llm.close()
    return out


def pp_overlap(root, device: str, large: bool = True) -> dict:
    """Each stage's busy time over wall time at PP 2 on a queue-filling workload,
    and the throughput against one process (a 0.1B-parameter model: enough work
    per stage that the stages' compute, not rank 0's host work, sets the pace)."""
    folder = root / ("wide-llama" if large else "tiny-llama-4-layers")
    if not (folder / "config.json").is_file():
        wide = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8,
                "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128}  # fmt: skip
        shape = wide if large else {"num_hidden_layers": 4}
        write_model(folder, preset_config("tiny-llama") | shape, seed=3)
    prompts = random_prompts(16, 48, 500, seed=93)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    out = {}
    for pp in (1, 2):
        llm = LLM(folder, device=device, dtype="float32", pipeline_parallel_size=pp)
        try:
            llm.generate(prompts[:2], GREEDY)  # warm-up
            before = llm.engine.runner.parallel_stats()
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - start
            after = llm.engine.runner.parallel_stats()
        finally:
            llm.close()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        out[f"pp{pp}"] = {
            "wall_s": wall,
            "output_tokens_per_s": tokens / wall,
            "busy_fraction": [
                (a["busy_seconds"] - b["busy_seconds"]) / wall for a, b in zip(after, before)
            ],  # fmt: skip
        }
    out["speedup"] = out["pp2"]["output_tokens_per_s"] / out["pp1"]["output_tokens_per_s"]
    out["min_stage_busy_pp2"] = min(out["pp2"]["busy_fraction"])
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument(
        "--full", action="store_true", help="on the CPU too: every size on every tiny preset"
    )
    args = parser.parse_args(argv)
    with Sections(args, script="parallel") as section:
        device = section.device
        section("ceilings", lambda: ceilings.measure(device))
        full = device == "cuda" or args.full
        # dry: one preset (its MoE layers too) at both layouts; tests/engine/test_parallel.py
        # checks every layout of every tiny preset
        presets = TINY_PRESETS + DEEPER if full else ("tiny-moe",)
        sizes = SIZES if full else ((2, 1), (1, 2))
        section("equality", lambda: equality(section.tmp, device, presets, sizes))
        section("pp_overlap", lambda: pp_overlap(section.tmp, device, large=full))
        gpus = torch.cuda.device_count() if device == "cuda" else 0
        section("tp_scaling", lambda: tp_scaling(section.tmp, "llama3-8b", gpus),
                needs="2 GPUs", gpus=2)  # fmt: skip
        section("pp_throughput", lambda: pp_throughput(section.tmp, "llama3-8b"),
                needs="2 GPUs", gpus=2)  # fmt: skip
        overlap = section.results.get("pp_overlap") or {}
        print(
            f"equal: {(section.results.get('equality') or {}).get('all_equal')}  "
            f"pp2 stage busy: {overlap.get('pp2', {}).get('busy_fraction')}  "
            f"speed-up over pp1: {overlap.get('speedup')}"
        )
        return section.results


if __name__ == "__main__":
    main()
