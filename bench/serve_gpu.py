"""Serving benchmarks on one GPU with the llama3-8b preset (bf16, dummy weights):

1. engine offline throughput, 1000 prompts of 1024 random tokens generating 128
   (vLLM's default `random` workload), and Hugging Face transformers' continuous
   batching on the same prompts in the same run (random weights of the same
   shapes: throughput does not depend on the values), with the ratio;
2. a serve sweep through the gateway (request rates up to saturation) with
   TTFT/TPOT p50/p99, and the highest rate at which TTFT p99 <= 200 ms and
   TPOT p99 <= 50 ms.

Usage: python -m bench.serve_gpu --out DIR [--skip serve offline peer]
The serve sweep runs first and the transformers peer last: the peer is the
slow part (several minutes for the 1000 prompts), so split the sections over
calls when a call's time is short.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from pathlib import Path

from bench.ceilings import measure
from bench.datasets import load_tokenizer, random_requests
from bench.engine_bench import run_engine, run_transformers
from engine.make_model import preset_config, write_model
from services.common.processes import free_port
from yinian.mesh import Mesh, MeshSpec

ENGINE = {
    "dtype": "bfloat16",
    "device": "cuda",
    "load_format": "dummy",
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "max_model_len": 4096,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--rates", default="4,8,16,24,32,inf")
    parser.add_argument("--prompts-per-rate", type=int, default=160)
    parser.add_argument(
        "--peer-prompts",
        type=int,
        default=None,
        help="run the peer (and the engine again, for the ratio) on the first N prompts only",
    )
    parser.add_argument("--skip", nargs="*", default=[])
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"ceilings": measure()}
    save = lambda: (out / "serve.json").write_text(json.dumps(results, indent=2, default=str))  # noqa: E731
    folder = write_model(
        Path(tempfile.mkdtemp()) / "llama3-8b", preset_config("llama3-8b"), weights=False
    )
    tok = load_tokenizer(folder)
    requests = random_requests(tok, args.num_prompts, 1024, 128, seed=0, prompt_format="ids")
    if "serve" not in args.skip:
        argv = [
            "--device",
            "cuda",
            "--dtype",
            "bfloat16",
            "--load-format",
            "dummy",
            "--max-num-seqs",
            "256",
            "--max-model-len",
            "4096",
        ]
        spec = MeshSpec(model=str(folder), workers=1, port=free_port(), engine_argv=argv)
        mesh = Mesh(spec).start(timeout=600)
        try:
            from bench.cli import run as bench_run

            start = time.monotonic()
            rc = bench_run(
                [
                    "serve",
                    "--base-url",
                    mesh.url,
                    "--model",
                    str(folder),
                    "--model-name",
                    "llama3-8b",
                    "--dataset-name",
                    "random",
                    "--num-prompts",
                    str(args.prompts_per_rate),
                    "--random-input-len",
                    "1024",
                    "--random-output-len",
                    "128",
                    "--prompt-format",
                    "ids",
                    "--request-rates",
                    args.rates,
                    "--goodput",
                    "ttft:200",
                    "tpot:50",
                    "--disable-tqdm",
                    "--result-dir",
                    str(out),
                    "--result-filename",
                    "sweep.json",
                ]
            )
            results["serve_rc"] = rc
            results["serve_seconds"] = time.monotonic() - start
        finally:
            mesh.stop()
        sweep = json.loads((out / "sweep-sweep.json").read_text())
        rows = []
        for r in sweep["runs"]:
            rows.append(
                {
                    k: r.get(k)
                    for k in (
                        "request_rate",
                        "completed",
                        "failed",
                        "request_throughput",
                        "output_throughput",
                        "median_ttft_ms",
                        "p99_ttft_ms",
                        "median_tpot_ms",
                        "p99_tpot_ms",
                        "request_goodput",
                    )
                }
            )
        results["sweep"] = rows
        ok = [
            r
            for r in rows
            if r["failed"] == 0
            and r["p99_ttft_ms"] is not None
            and r["p99_ttft_ms"] <= 200
            and r["p99_tpot_ms"] <= 50
        ]
        results["max_rate_within_slo"] = max(
            (float(r["request_rate"]) if r["request_rate"] != "inf" else float("inf") for r in ok),
            default=None,
        )
        save()
    if "offline" not in args.skip:
        try:
            results["engine"] = run_engine(str(folder), requests, dict(ENGINE))
        except Exception:
            results["offline_error"] = traceback.format_exc()
            print(results["offline_error"], flush=True)
        save()
    if "peer" not in args.skip:
        subset = requests[: args.peer_prompts or len(requests)]
        ours = results.get("engine")
        if len(subset) < len(requests) or ours is None:  # the engine on the peer's prompts
            ours = results["engine_on_peer_prompts"] = run_engine(str(folder), subset, dict(ENGINE))
            save()
        peer = run_transformers(
            str(folder),
            [r.prompt for r in subset],
            [r.output_len for r in subset],
            {"dtype": "bfloat16", "device": "cuda"},
            {"random_weights": True},
        )
        results["transformers"] = peer
        if ours and "error" not in peer:
            results["ratio_output_tokens_per_s"] = (
                ours["output_tokens_per_s"] / peer["output_tokens_per_s"]
            )
        save()
    print_table(results)


def print_table(results: dict) -> None:
    e, p = results.get("engine"), results.get("transformers")
    if e:
        print(
            f"engine offline 1000x1024->128: {e['output_tokens_per_s']:.0f} out tok/s, "
            f"{e['total_tokens_per_s']:.0f} total tok/s"
        )
    sub = results.get("engine_on_peer_prompts")
    if sub:
        print(f"engine on the peer's prompts: {sub['output_tokens_per_s']:.0f} out tok/s")
    if p:
        print("transformers:", {k: p.get(k) for k in ("output_tokens_per_s", "error")})
    print("ratio:", results.get("ratio_output_tokens_per_s"))
    print("| rate | done | fail | req/s | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results.get("sweep", []):
        print(
            f"| {r['request_rate']} | {r['completed']} | {r['failed']} | "
            f"{r['request_throughput']:.2f} | {r['output_throughput']:.0f} | "
            f"{r['median_ttft_ms']} | {r['p99_ttft_ms']} | {r['median_tpot_ms']} | "
            f"{r['p99_tpot_ms']} |"
        )
    print(
        "max rate within TTFT p99 <= 200 ms and TPOT p99 <= 50 ms:",
        results.get("max_rate_within_slo"),
    )


if __name__ == "__main__":
    main()
