"""Does the mock runner's fitted H200 timing reproduce a committed H200 serving run?
On this machine: a mesh (gateway, scheduler, NATS, one worker; no KV store, no
host tier) whose worker is the mock runner on llama3-8b's config with
`--mock-device h200`, every step slowed `--scale` times, is sent the committed
run's workload (random 1024-token prompts generating 128, Poisson) at each rate
divided by the scale; its latencies divided by the scale (its throughput
multiplied by it) are set beside the reference run's default meshes at the same
rates. Slowing the mock lets the services' own CPU time on a small machine
shrink beside the modelled steps; the services' time on the H200's host (a short
prompt's TTFT there less a step, which the fit took out of the device's share)
is then added to the simulated first tokens, shown apart.

    python -m bench.step_time_check --out bench/results/step_time_check_cpu.json
        [--reference bench/results/kv_serving_815563c_dbd.json] [--rates 8,16]
        [--scale 10] [--prompts-per-rate 160]"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.gpu.kv_serving_compare import kind_of
from bench.loadgen.cli import run as bench_run
from bench.loadgen.serve import written_runs
from engine.make_model import preset_config, write_model
from engine.step_time_model import DeviceProfile
from yinian.mesh import Mesh, MeshSpec

RESULTS = Path(__file__).parent / "results"
COMPARED = ("median_ttft_ms", "median_tpot_ms", "p99_ttft_ms", "p99_tpot_ms")


def reference_rows(path: Path, rates: list[float]) -> dict[float, dict]:
    """The mean of the reference file's default meshes (`default`, `default_2`, ...)
    at each rate."""
    data = json.loads(path.read_text())
    runs = [v for k, v in data.items() if kind_of(k) == "default" and "rows" in v]
    out = {}
    for rate in rates:
        rows = [r for run in runs for r in run["rows"] if r["request_rate"] == rate]
        if not rows:
            raise ValueError(f"{path} has no default run at {rate} req/s")
        keys = COMPARED + ("output_throughput",)
        out[rate] = {k: statistics.mean(r[k] for r in rows) for k in keys} | {"runs": len(rows)}
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reference", type=Path, default=RESULTS / "kv_serving_815563c_dbd.json")
    parser.add_argument("--rates", default="8,16")
    parser.add_argument("--scale", type=float, default=10.0)
    parser.add_argument("--prompts-per-rate", type=int, default=160)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args(argv)
    if args.scale <= 0 or args.prompts_per_rate < 1:
        parser.error("--scale must be > 0 and --prompts-per-rate >= 1")
    rates = [float(r) for r in args.rates.split(",")]
    reference = reference_rows(args.reference, rates)
    scale = args.scale
    with tempfile.TemporaryDirectory(prefix="yinian-steptime-") as tmp:
        folder = Path(tmp) / "llama3-8b"
        write_model(folder, preset_config("llama3-8b"), weights=False)
        engine = ["--model-runner", "mock", "--mock-device", "h200", "--mock-time-scale",
                  str(scale), "--dtype", "bfloat16", "--max-num-seqs", "256",
                  "--max-model-len", "4096", "--host-kv-cache-gb", "0",
                  "--num-gpu-blocks", "8192"]  # fmt: skip
        mesh = Mesh(MeshSpec(model=str(folder), port=0, kvstore=False, engine_argv=engine))
        out_dir = args.out.with_suffix("")
        out_dir.mkdir(parents=True, exist_ok=True)
        mesh.start(timeout=300)
        try:
            common = ["serve", "--base-url", mesh.url, "--model", str(folder),
                      "--model-name", "llama3-8b", "--dataset-name", "random",
                      "--random-input-len", str(args.input_len), "--random-output-len",
                      str(args.output_len), "--prompt-format", "ids", "--disable-tqdm",
                      "--result-dir", str(out_dir)]  # fmt: skip
            warmup = ["--num-prompts", "4", "--seed", "1000", "--request-rate", "inf",
                      "--no-plots", "--result-filename", "warmup.json"]  # fmt: skip
            bench_run(common + warmup)
            start = time.monotonic()
            rc = bench_run(common + [
                "--num-prompts", str(args.prompts_per_rate), "--request-rates",
                ",".join(f"{r / scale:g}" for r in rates), "--result-filename", "sim.json",
            ])  # fmt: skip
            seconds = time.monotonic() - start
        finally:
            mesh.stop()
    service = DeviceProfile.load("h200").service_ms  # the profile's fit of it
    result = {"script": "step_time_check", "scale": scale, "rates": rates, "rc": rc,
              "gpu_service_ms": service,
              "prompts_per_rate": args.prompts_per_rate, "sweep_seconds": seconds,
              "reference": str(args.reference), "rows": []}  # fmt: skip
    for rate, run in zip(rates, written_runs(out_dir, "sim")):
        sim = {k: run[k] / scale for k in COMPARED}
        sim["output_throughput"] = run["output_throughput"] * scale
        ref = reference[rate]
        # the services' time on the GPU's host, which the fit took out of the device's
        # share and a slowed simulation's own services (at this machine's speed, not
        # slowed) do not give back: added to its first tokens, apart
        served = {k: sim[k] + service for k in ("median_ttft_ms", "p99_ttft_ms")}
        row = {"rate": rate, "simulated": sim, "measured": ref,
               "ratio": {k: sim[k] / ref[k] for k in sim},
               "simulated_with_service": served,
               "ratio_with_service": {k: served[k] / ref[k] for k in served},
               "completed": run["completed"], "failed": run["failed"]}  # fmt: skip
        result["rows"].append(row)
        print(f"{rate:g} req/s: " + ", ".join(
            f"{k} {sim[k]:.2f} / {ref[k]:.2f} = {row['ratio'][k]:.3f}" for k in sim
        ))  # fmt: skip
        print(f"{rate:g} req/s, with the H200 host's {service:.1f} ms of services: " + ", ".join(
            f"{k} {served[k]:.2f} = {row['ratio_with_service'][k]:.3f}" for k in served
        ))  # fmt: skip
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
