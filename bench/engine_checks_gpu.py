"""On the GPU: the engine with Triton kernels and CUDA graphs checked against
itself on the torch references (bench/engine_kernels_check.py), for the tiny
presets and llama3-8b, in each dtype asked for, after how far two torch
references part in bfloat16.

Usage: python -m bench.engine_checks_gpu --out DIR [--dtypes float32 bfloat16]
           [--skip NAME ...]
Section names: "<model>/<dtype>" and "spread/<model>". Writes
DIR/engine_checks.json after every section and prints a summary last.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from bench.ceilings import measure
from bench.engine_kernels_check import check_model, reference_spread
from bench.sections import Sections
from engine.make_model import TINY_PRESETS, preset_config, write_model

SPREAD_MODELS = ("tiny-qwen3", "tiny-moe", "llama3-8b")


def prompts_for(name: str, lengths, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(len(name) * 1000 + sum(map(ord, name)))
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def models(tmp: Path) -> dict:
    """name -> (folder, load format, prompts, engine options)."""
    found = {}
    for preset in TINY_PRESETS:
        folder = write_model(tmp / preset, preset_config(preset), seed=1)
        prompts = prompts_for(preset, (1, 17, 200, 700), 500)
        found[preset] = (folder, "auto", prompts, dict(max_num_seqs=16))
    llama = write_model(tmp / "llama3-8b", preset_config("llama3-8b"), weights=False)
    prompts = prompts_for("llama3-8b", (1, 33, 500, 2000), 120000)
    found["llama3-8b"] = (llama, "dummy", prompts, dict(max_num_seqs=16, max_model_len=8192))
    return found


def run(out: Path, dtypes: list[str], skip: list[str]) -> dict:
    results: dict = {"ceilings": measure()}
    section = Sections(results, out / "engine_checks.json", skip)
    found = models(Path(tempfile.mkdtemp()))
    for name in SPREAD_MODELS:  # bfloat16: two torch references, fused vs upcast attention
        folder, load_format, prompts, options = found[name]
        section(
            f"spread/{name}",
            lambda f=folder, lf=load_format, p=prompts, o=options: reference_spread(
                f, lf, p, 24, **o
            ),
        )
    for name, (folder, load_format, prompts, options) in found.items():
        for dtype in dtypes:
            section(
                f"{name}/{dtype}",
                lambda f=folder, lf=load_format, p=prompts, o=options, d=dtype: check_model(
                    f, lf, p, 24, dtype=d, **o
                ),
            )
    return results


def summary(results: dict) -> list[str]:
    lines = []
    for name, check in results.items():
        if not isinstance(check, dict) or "greedy" not in check:
            continue
        parts = [
            "equal" if g["equal"] else f"parts at {g['diverged_at']} (gap {g['logprob_gap']:.4f})"
            for g in check["greedy"]
        ]
        lines.append(
            f"{name}: passed={check['passed']} logits rel err "
            f"{max(check['prompt_logits_rel_error']):.2e}, logprob diff "
            f"{check['max_logprob_diff_before_divergence']:.3f}; greedy: {', '.join(parts)}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--skip", nargs="*", default=[])
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = run(out, args.dtypes, args.skip)
    print(json.dumps(results, indent=1, default=str)[-2000:])
    print("\n".join(summary(results)))


if __name__ == "__main__":
    main()
