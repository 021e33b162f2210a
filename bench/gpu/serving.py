"""Serving benchmarks on one GPU with the llama3-8b preset (bf16, dummy weights):

1. a serve sweep through the gateway (`yinian bench serve`, request rates up to
   saturation, after a warm-up of other prompts at the top rate) with TTFT/TPOT
   p50/p99, and the highest rate at which TTFT p99 <= 200 ms and TPOT p99 <= 50 ms;
2. engine offline throughput, 1000 prompts of 1024 random tokens generating 128
   (vLLM's default `random` workload);
3. Hugging Face transformers' continuous batching on the same prompts in the same
   run (random weights of the same shapes: throughput does not depend on the
   values), with the ratio.

With `--third-party`, guidellm (a load generator we did not write) runs on the same
mesh right after the sweep, at the sweep's finite rates on the same workload, and
each of its figures is put beside ours (bench/loadgen/guidellm_run.py).

Usage: python -m bench.gpu.serving --out bench/results/serving.json
           [--skip serve offline peer] [--rates 4,8,inf] [--repeat-prompts]
           [--peer-prompts N] [--third-party]
Sections: ceilings, serve, offline, peer. The sweep's own files (per-rate JSON, plots)
go to the folder named like the JSON without its suffix (bench/results/serving/). The
peer is the slow part (several minutes for the 1000 prompts), so split the sections
over calls when a call's time is short.
"""

from __future__ import annotations

import dataclasses
import time

from bench.gpu import ceilings
from bench.gpu.mesh_warmup import warm_up
from bench.gpu.models import preset_folder
from bench.gpu.sections import Sections, script_parser
from bench.loadgen import guidellm_run
from bench.loadgen.datasets import load_tokenizer, random_requests
from bench.loadgen.engine_bench import run_engine, run_transformers
from yinian.mesh import Mesh, MeshSpec
from yinian.mesh_probe import wait_store_mapped

SWEEP_KEYS = ("request_rate", "offered_rate", "completed", "failed", "request_throughput",
              "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
              "request_goodput")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Workload:
    preset: str
    num_prompts: int
    input_len: int
    output_len: int
    rates: str
    prompts_per_rate: int
    repeat_prompts: bool = False  # every rate on the first rate's prompts (as before 915c65d)
    engine_flags: tuple[str, ...] = ()  # more flags for the mesh's worker
    third_party: bool = False  # guidellm on the same mesh at the sweep's finite rates too

    def engine(self, device: str) -> dict:
        return {"dtype": "bfloat16" if device == "cuda" else "float32", "device": device,
                "load_format": "dummy", "max_num_seqs": 256, "max_num_batched_tokens": 8192,
                "max_model_len": 4096}  # fmt: skip


GPU = Workload("llama3-8b", 1000, 1024, 128, "4,8,16,24,32,inf", 160)
DRY = Workload("tiny-llama", 4, 32, 8, "16,inf", 4)


def serve_sweep(w: Workload, folder, device: str, out_dir) -> dict:
    from bench.loadgen.cli import run as bench_run
    from bench.loadgen.serve import written_runs

    options = w.engine(device)
    argv = ["--device", device, "--dtype", options["dtype"], "--load-format", "dummy",
            "--max-num-seqs", "256", "--max-model-len", "4096", *w.engine_flags]  # fmt: skip
    mesh = Mesh(MeshSpec(model=str(folder), workers=1, port=0, engine_argv=argv))
    mesh.start(timeout=600)
    try:
        # as a mesh serving for long: its store's memory tier pinned, its kernels chosen
        wait_store_mapped(mesh)
        finite = [r for r in w.rates.split(",") if r != "inf"]
        warm_up(mesh.url, folder, w.preset, min(64, w.prompts_per_rate), w.input_len,
                w.output_len, finite[-1] if finite else "inf", out_dir, "warmup.json")  # fmt: skip
        start = time.monotonic()
        rc = bench_run([
            "serve", "--base-url", mesh.url, "--model", str(folder), "--model-name", w.preset,
            "--dataset-name", "random", "--num-prompts", str(w.prompts_per_rate),
            "--random-input-len", str(w.input_len), "--random-output-len", str(w.output_len),
            "--prompt-format", "ids", "--request-rates", w.rates, "--goodput", "ttft:200",
            "tpot:50", "--disable-tqdm", "--result-dir", str(out_dir),
            "--result-filename", "sweep.json",
        ] + (["--sweep-repeat-requests"] if w.repeat_prompts else []))  # fmt: skip
        seconds = time.monotonic() - start
        rows = [{k: r.get(k) for k in SWEEP_KEYS} for r in written_runs(out_dir, "sweep")]
        theirs = third_party(w, folder, mesh.url, rows, out_dir) if w.third_party else None
    finally:
        mesh.stop()
    best = max((float(r["request_rate"]) for r in rows if guidellm_run.within_slo(r)),
               default=None)  # fmt: skip
    result = {"rc": rc, "seconds": seconds, "sweep": rows, "max_rate_within_slo": best}
    return result if theirs is None else result | {"third_party": theirs}


def third_party(w: Workload, folder, url: str, ours: list[dict], out_dir) -> dict:
    """guidellm on the same mesh, after our sweep, at its finite rates; each figure
    beside ours."""
    rates = [float(r["request_rate"]) for r in ours if float(r["request_rate"]) != float("inf")]
    # an error where guidellm does not run here (THIRD_PARTY=1 bench/gpu/wheels.sh: .whl_tp)
    theirs = guidellm_run.run(url, str(folder), rates, w.prompts_per_rate, w.input_len,
                              w.output_len, out_dir / "guidellm")  # fmt: skip
    if "error" not in theirs:
        theirs["agreement"] = guidellm_run.agreement(ours, theirs["sweep"])
    return theirs


def peer(w: Workload, folder, requests, device: str, ours: dict | None) -> dict:
    """transformers on `requests`; the engine again on the same ones unless `ours` is
    the engine's result on exactly these."""
    result = {}
    if ours is None:
        ours = result["engine_on_peer_prompts"] = run_engine(str(folder), requests,
                                                             w.engine(device))  # fmt: skip
    theirs = run_transformers(
        str(folder), [r.prompt for r in requests], [r.output_len for r in requests],
        {"dtype": w.engine(device)["dtype"], "device": device}, {"random_weights": True},
    )  # fmt: skip
    if "error" in theirs:
        raise RuntimeError(f"transformers: {theirs['error']}")
    ratio = ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]
    return result | {"transformers": theirs, "ratio_output_tokens_per_s": ratio}


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--num-prompts", type=int)
    parser.add_argument("--rates")
    parser.add_argument("--prompts-per-rate", type=int)
    parser.add_argument("--repeat-prompts", action="store_true", help="every rate on the "
                        "same prompts (device hits after the first rate), as serving.json's "
                        "sweep before 915c65d ran")  # fmt: skip
    parser.add_argument("--engine-flags", default="", help="more flags for the mesh's "
                        "worker, one string (--engine-flags=--no-graph-prompt-rows)")  # fmt: skip
    parser.add_argument(
        "--third-party",
        action="store_true",
        help="guidellm too, on the same "
        "mesh after the sweep, at its finite rates (bench/loadgen/guidellm_run.py)",
    )
    parser.add_argument("--peer-prompts", type=int, help="run the peer (and the engine again, "
                        "for the ratio) on the first N prompts only")  # fmt: skip
    args = parser.parse_args(argv)
    w = GPU if args.device == "cuda" else DRY
    w = dataclasses.replace(
        w,
        num_prompts=args.num_prompts or w.num_prompts,
        rates=args.rates or w.rates,
        prompts_per_rate=args.prompts_per_rate or w.prompts_per_rate,
        repeat_prompts=args.repeat_prompts,
        engine_flags=tuple(args.engine_flags.split()),
        third_party=args.third_party,
    )
    with Sections(args, script="serving", preset=w.preset) as section:
        device, out_dir = section.device, args.out.with_suffix("")
        section("ceilings", lambda: ceilings.measure(device))
        folder, _ = preset_folder(section.tmp, w.preset)
        requests = random_requests(load_tokenizer(folder), w.num_prompts, w.input_len,
                                   w.output_len, seed=0, prompt_format="ids")  # fmt: skip
        section("serve", lambda: serve_sweep(w, folder, device, out_dir))
        offline = section("offline", lambda: run_engine(str(folder), requests, w.engine(device)))
        subset = requests[: args.peer_prompts or len(requests)]
        ours = offline if len(subset) == len(requests) else None
        section("peer", lambda: peer(w, folder, subset, device, ours))
        print_table(section.results)
        return section.results


def table_row(label: str, r: dict) -> str:
    """One sweep row (ours or guidellm's) as a line of the table; "-" for a figure missing."""

    def num(key: str, digits: int) -> str:
        return "-" if r.get(key) is None else f"{r[key]:.{digits}f}"

    cells = [label, num("offered_rate", 1), str(r["completed"]), str(r["failed"]),
             num("request_throughput", 2), num("output_throughput", 0), num("median_ttft_ms", 1),
             num("p99_ttft_ms", 1), num("median_tpot_ms", 2), num("p99_tpot_ms", 2)]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def print_table(results: dict) -> None:
    e, p = results.get("offline") or {}, results.get("peer") or {}
    if "output_tokens_per_s" in e:
        print(f"engine offline: {e['output_tokens_per_s']:.0f} out tok/s, "
              f"{e['total_tokens_per_s']:.0f} total tok/s")  # fmt: skip
    if "transformers" in p:
        print(f"transformers: {p['transformers']['output_tokens_per_s']:.0f} out tok/s; "
              f"ratio {p['ratio_output_tokens_per_s']:.2f}")  # fmt: skip
    print("| rate | sent/s | done | fail | req/s | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | "
          "TPOT p99 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    serve = results.get("serve") or {}
    for r in serve.get("sweep", []):
        print(table_row(str(r["request_rate"]), r))
    if "max_rate_within_slo" in serve:
        print("max rate within TTFT p99 <= 200 ms and TPOT p99 <= 50 ms:",
              serve["max_rate_within_slo"])  # fmt: skip
    theirs = serve.get("third_party") or {}
    if "error" in theirs:
        print("guidellm:", theirs["error"])
    for r in theirs.get("sweep", []):
        print(table_row(f"guidellm {r['request_rate']}", r))
    for a in theirs.get("agreement", []):
        ratios = ", ".join(f"{k} {v:.3f}" if v is not None else f"{k} -"
                           for k, v in a["ratio_theirs_to_ours"].items())  # fmt: skip
        print(f"rate {a['request_rate']}: guidellm/ours {ratios}; within 10%: "
              f"{a['all_within_10pct']}")  # fmt: skip


if __name__ == "__main__":
    main()
