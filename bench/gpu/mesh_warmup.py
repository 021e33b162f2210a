"""A serving mesh warmed up before it is measured: random prompts of the workload's
lengths with a seed no measured rate uses (1000), sent by `yinian bench serve` at
the top rate and not recorded, so that kernels a first mesh would tune or compile
for the first time do not count against the sweep that follows."""

from __future__ import annotations

from pathlib import Path

WARMUP_SEED = "1000"


def warm_up(url: str, folder: Path, preset: str, prompts: int, input_len: int, output_len: int,
            rate: str, out_dir: Path, filename: str) -> int:  # fmt: skip
    """`bench serve`'s exit status; its result goes to out_dir/filename."""
    from bench.loadgen.cli import run as bench_run

    return bench_run([
        "serve", "--base-url", url, "--model", str(folder), "--model-name", preset,
        "--dataset-name", "random", "--num-prompts", str(prompts), "--seed", WARMUP_SEED,
        "--random-input-len", str(input_len), "--random-output-len", str(output_len),
        "--prompt-format", "ids", "--request-rate", rate, "--disable-tqdm", "--no-plots",
        "--result-dir", str(out_dir), "--result-filename", filename,
    ])  # fmt: skip
