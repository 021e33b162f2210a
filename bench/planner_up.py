"""The SLA planner scaling a real `yinian up` mesh on this machine (issue 34): the
workers run the mock engine (each step sleeps its modelled time, so a worker's
capacity is its own and not this host's two cores), everything else is real:
gateway, scheduler, NATS, worker processes started and drained by the planner.

1. One worker's capacity profile: `yinian bench serve` sweeps rising rates against
   `yinian up --workers 1` (PROFILE-sweep.json).
2. `yinian up --planner-profile PROFILE-sweep.json`, then a load whose rate rises
   and falls (phases of Poisson arrivals); every request's outcome, the planner's
   decisions (its planner.jsonl) and the console's lines are kept, and plotted.

Usage: python -m bench.planner_up --out bench/results/planner_up
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.loadgen.client import RequestInput, make_client, send_request
from bench.up_process import UpProcess

# a worker: at most 8 sequences a step, each step 40 ms (+5 us a token)
MOCK = ["--model-runner", "mock", "--mock-step-ms", "40", "--mock-token-us", "5",
        "--max-num-seqs", "8", "--no-kvstore", "--port", "0", "--grpc-port", "0"]  # fmt: skip
# (requests a second, seconds): a rate one worker serves, rising to one it cannot, falling
PHASES = ((2.0, 20.0), (6.0, 30.0), (10.0, 40.0), (2.0, 45.0))
SLOS = ["--ttft-slo-ms", "300", "--itl-slo-ms", "100"]
INPUT_LEN, OUTPUT_LEN = 64, 24


def profile(model: str, out: Path, rates: str, prompts: int) -> Path:
    """One worker's sweep; returns the sweep file."""
    up = UpProcess("--model", model, "--log-dir", str(out / "profile_logs"), *MOCK)
    try:
        up.wait_for("yinian is ready", timeout=120)
        subprocess.run([sys.executable, "-m", "yinian", "bench", "serve", "--base-url", up.url,
                        "--model", model, "--request-rates", rates, "--num-prompts", str(prompts),
                        "--random-input-len", str(INPUT_LEN), "--random-output-len",
                        str(OUTPUT_LEN), "--no-plots", "--result-dir", str(out),
                        "--result-filename", "profile"], check=True)  # fmt: skip
    finally:
        up.proc.terminate()
        up.proc.wait(timeout=60)
    return out / "profile-sweep.json"


async def load(url: str, model: str, phases, seed: int = 0) -> list[dict]:
    """Poisson arrivals at each phase's rate for its seconds; each request's outcome."""
    rng = random.Random(seed)
    t0 = time.monotonic()
    tasks = []
    async with make_client(300.0, None) as c:
        start = 0.0
        for rate, seconds in phases:
            at = start
            while True:
                at += rng.expovariate(rate)
                if at >= start + seconds:
                    break
                await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
                prompt = [rng.randrange(100, 400) for _ in range(INPUT_LEN)]
                request = RequestInput(f"{url}/v1/completions", model, prompt, INPUT_LEN,
                                       OUTPUT_LEN)  # fmt: skip
                tasks.append((at, asyncio.create_task(send_request(c, request))))
            start += seconds
        results = []
        for at, task in tasks:
            r = await task
            results.append({"sent": at, "success": r.success, "error": r.error,
                            "ttft_ms": r.ttft * 1e3 if r.success else None,
                            "output_tokens": r.output_tokens})  # fmt: skip
    return results


def scale(model: str, out: Path, sweep: Path, interval: float, phases, max_workers: int) -> dict:
    logs = out / "scale_logs"
    shutil.rmtree(logs, ignore_errors=True)
    up = UpProcess("--model", model, "--log-dir", str(logs), "--planner-profile", str(sweep),
                   "--planner-interval", str(interval), "--max-workers", str(max_workers),
                   *SLOS, *MOCK)  # fmt: skip
    try:
        up.wait_for("yinian is ready", timeout=120)
        results = asyncio.run(load(up.url, Path(model).name, phases))
        time.sleep(4 * interval)  # the last decisions, after the load
    finally:
        up.proc.terminate()
        up.proc.wait(timeout=120)
    decisions = [json.loads(line) for line in (logs / "planner.jsonl").read_text().splitlines()]
    return {"phases": phases, "interval": interval, "results": results,
            "decisions": decisions,
            "console": [line.rstrip() for line in up.lines if "planner:" in line]}  # fmt: skip


def summary(run: dict) -> dict:
    ok = [r for r in run["results"] if r["success"]]
    decided = [d["decided"] for d in run["decisions"]]
    return {"requests": len(run["results"]), "failed": len(run["results"]) - len(ok),
            "most_workers": max(decided, default=0),
            "last_workers": decided[-1] if decided else 0,
            "console": run["console"]}  # fmt: skip


def plot(run: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = run["decisions"][0]["time"] - run["interval"] if run["decisions"] else 0.0
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    times = [d["time"] - t0 for d in run["decisions"]]
    top.step(times, [d["workers"] for d in run["decisions"]], where="post", label="workers")
    top.step(times, [d["decided"] for d in run["decisions"]], where="post", ls="--",
             label="decided")  # fmt: skip
    top.plot(times, [d["requests"] / run["interval"] for d in run["decisions"]], "o-",
             label="req/s seen")  # fmt: skip
    top.legend()
    top.set_ylabel("workers, req/s")
    bottom.plot(times, [d["ttft_p99_ms"] for d in run["decisions"]], "o-", label="TTFT p99")
    bottom.plot(times, [d["itl_p99_ms"] for d in run["decisions"]], "s-", label="ITL p99")
    bottom.set_ylabel("ms")
    bottom.set_xlabel("seconds")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="", help="model folder (default: the bundled one)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rates", default="2,4,6,8", help="the profile's rates")
    p.add_argument("--profile-prompts", type=int, default=90)
    p.add_argument("--interval", type=float, default=5.0)
    p.add_argument("--max-workers", type=int, default=3)
    args = p.parse_args()
    if not args.model:
        from yinian.default_model import ensure_default_model

        args.model = str(ensure_default_model())
    args.out.mkdir(parents=True, exist_ok=True)
    sweep = profile(args.model, args.out, args.rates, args.profile_prompts)
    run = scale(args.model, args.out, sweep, args.interval, PHASES, args.max_workers)
    (args.out / "planner_up.json").write_text(json.dumps(run, indent=1))
    plot(run, args.out / "planner_up.png")
    print(json.dumps(summary(run), indent=1))


if __name__ == "__main__":
    main()
