"""A load generator we did not write, on the same mesh and workload as our own
`yinian bench serve` sweep: guidellm (`pip install guidellm`), its Poisson
profile at each rate, `count` requests a rate of `input_len` synthetic prompt
tokens generating `output_len` (ignore_eos) through /v1/completions, streamed.
Its report becomes rows with the keys of our sweep's rows, and `agreement`
puts each figure beside ours.

guidellm's worker processes each draw the same seeded sequence of Poisson gaps
(0.8.1: ten workers at rate 8 sent 40 requests in 1.9 s, about 21 a second),
so it runs with one worker process (`GUIDELLM__MAX_WORKER_PROCESSES=1`), whose
arrivals keep the rate asked (8.67 a second measured over 40 at rate 8). And a
second rate in the same invocation (`--override profile.rate 4,8`) sent its 64
requests at 160 a second, so each rate is its own invocation. Even so, now and
then an invocation's arrival times start from zero instead of its start (its
report's requests are `targeted_start` near 0 and its own `root_late` warning
fires) and every request goes out at once (64 at rate 4 in 0.45 s): such a run
is not a Poisson run at the rate, so it is run again, up to ATTEMPTS times, and
the attempts are reported. Its synthetic prompts follow a seed, 42 unless told:
each rate gets its own (the same prompts at a second rate found every block in the
prefix cache: TTFT p50 33 ms at 24 req/s against 81 ms by our client's fresh prompts).

Its figures, as this module reads them: TTFT from its `time_to_first_token_ms`;
TPOT from its `inter_token_latency_ms` (a request's time after its first token
over its further tokens: our TPOT's definition; its own `time_per_output_token_ms`
counts the first token's wait too); throughput over the span from its first
request's start to its last request's end; the offered rate from its requests'
starts (`metrics.offered_rate`, as ours), compared first: two clients' figures at
one named rate say little unless they sent the same load (stop 82's H100 sweep: at
"24" guidellm sent 26.5 requests a second and our client 21.2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.loadgen.metrics import offered_rate

SLO = {"ttft_ms": 200.0, "tpot_ms": 50.0}
# the figures compared with ours, and the one relative difference counted as agreeing
COMPARED = ("offered_rate", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "p99_tpot_ms")  # fmt: skip
TOLERANCE = 0.10
ATTEMPTS = 4


def probe() -> dict:
    """{"version": guidellm's version} where this interpreter runs its command line,
    else {"error": why not}."""
    ran = subprocess.run([sys.executable, "-m", "guidellm", "--version"], capture_output=True,
                         text=True)  # fmt: skip
    if ran.returncode != 0:
        return {"error": f"guidellm does not run here: {(ran.stderr or ran.stdout)[-1500:]}"}
    return {"version": ran.stdout.strip().split()[-1]}


def served_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def command(url: str, model: str, tokenizer: str, rate: float, count: int,
            input_len: int, output_len: int, out_json: Path) -> list[str]:  # fmt: skip
    if not 0 < rate < float("inf"):
        raise ValueError(f"guidellm's Poisson profile needs a finite positive rate, not {rate}")
    backend = f"kind=openai_http,target={url},model={model},request_format=/v1/completions"
    return [
        sys.executable, "-m", "guidellm", "run", "--backend", backend,
        "--profile", f"kind=poisson,rate={rate:g}",
        "--constraint", f"kind=max_requests,count={count}",
        "--data", f"kind=synthetic_text,prompt_tokens={input_len},output_tokens={output_len}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        # its prompts' seed: the same prompts at every rate would hit the prefix cache
        "--seed", f"kind=static,value={1000 + int(rate * 1000)}",
        "--output", f"kind=json,path={out_json}",
        "--disable-progress",
    ]  # fmt: skip


def _stat(metrics: dict, name: str, which: str) -> float | None:
    summary = (metrics.get(name) or {}).get("successful") or {}
    if not summary.get("count"):
        return None
    return summary["median"] if which == "median" else summary["percentiles"][which]


def _every(bench: dict) -> list[dict]:
    """A benchmark's requests: the successful first, then the errored and incomplete."""
    requests = bench["requests"]
    return sum((requests.get(k) or [] for k in ("successful", "errored", "incomplete")), [])


def on_schedule(report: dict) -> bool:
    """Whether every benchmark's arrivals were timed from its start (see above)."""
    for bench in report["benchmarks"]:
        targets = [r["info"]["timings"].get("targeted_start") for r in _every(bench)]
        if any(t is None or t < bench["start_time"] - 1.0 for t in targets):
            return False
    return True


def rows_of(report: dict) -> list[dict]:
    """One row a benchmark (rate) of a guidellm JSON report, with our sweep's keys."""
    rows = []
    for bench in report["benchmarks"]:
        m, every = bench["metrics"], _every(bench)
        done = bench["requests"].get("successful") or []
        timings = [r["info"]["timings"] for r in every]
        starts = [t["request_start"] for t in timings if t.get("request_start")]
        ends = [t["request_end"] for t in timings if t.get("request_end")]
        span = (max(ends) - min(starts)) if starts and ends else None
        out_tokens = ((m.get("output_token_count") or {}).get("successful") or {}).get(
            "total_sum", 0.0
        )
        row = {
            "request_rate": bench["config"]["strategy"]["rate"],
            "offered_rate": offered_rate(starts),
            "completed": len(done),
            "failed": len(every) - len(done),
            "request_throughput": len(done) / span if span else None,
            "output_throughput": out_tokens / span if span else None,
            "median_ttft_ms": _stat(m, "time_to_first_token_ms", "median"),
            "p99_ttft_ms": _stat(m, "time_to_first_token_ms", "p99"),
            "median_tpot_ms": _stat(m, "inter_token_latency_ms", "median"),
            "p99_tpot_ms": _stat(m, "inter_token_latency_ms", "p99"),
            "median_prompt_tokens": _stat(m, "prompt_token_count", "median"),
            "worker_processes": bench["config"]["strategy"].get("worker_count"),
        }
        rows.append(row)
    return rows


def within_slo(row: dict) -> bool:
    if row["failed"] or row["p99_ttft_ms"] is None or row["p99_tpot_ms"] is None:
        return False
    return row["p99_ttft_ms"] <= SLO["ttft_ms"] and row["p99_tpot_ms"] <= SLO["tpot_ms"]


def run(url: str, tokenizer: str, rates: list[float], count: int, input_len: int,
        output_len: int, out_dir: Path, timeout: float | None = None) -> dict:  # fmt: skip
    """guidellm against `url` at each rate, one invocation a rate; its rows and the
    highest rate within the SLOs by its figures (or the first failure's output)."""
    result: dict = probe() | {"argv": [], "seconds": 0.0, "sweep": []}
    if "error" in result:
        return result
    out_dir.mkdir(parents=True, exist_ok=True)
    model, env = served_model(url), dict(os.environ, GUIDELLM__MAX_WORKER_PROCESSES="1")
    for rate in rates:
        report = out_dir / f"guidellm-rate{rate:g}.json"
        argv = command(url, model, tokenizer, rate, count, input_len, output_len, report)
        result["argv"].append(argv[1:])
        attempts, on_time = 0, False
        while attempts < ATTEMPTS and not on_time:
            attempts += 1
            report.unlink(missing_ok=True)
            start = time.monotonic()
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
            result["seconds"] += time.monotonic() - start
            if proc.returncode != 0 or not report.exists():
                return result | {"rc": proc.returncode,
                                 "error": (proc.stderr or proc.stdout)[-2000:]}  # fmt: skip
            parsed = json.loads(report.read_text())
            on_time = on_schedule(parsed)
        rows = rows_of(parsed)
        for row in rows:
            row |= {"attempts": attempts, "on_schedule": on_time}
        result["sweep"] += rows
    timed = [r for r in result["sweep"] if r["on_schedule"]]
    best = max((float(r["request_rate"]) for r in timed if within_slo(r)), default=None)
    return result | {"rc": 0, "max_rate_within_slo": best}


def agreement(ours: list[dict], theirs: list[dict]) -> list[dict]:
    """At each rate both swept: each compared figure's ratio theirs/ours, whether
    all are within TOLERANCE, and whether each finds the rate within the SLOs."""
    by_rate = {float(r["request_rate"]): r for r in ours}
    rows = []
    for t in theirs:
        o = by_rate.get(float(t["request_rate"]))
        if o is None:
            continue
        ratios = {k: (t[k] / o[k] if t.get(k) is not None and o.get(k) else None)
                  for k in COMPARED}  # fmt: skip
        agreed = all(r is not None and abs(r - 1) <= TOLERANCE for r in ratios.values())
        rows.append({"request_rate": t["request_rate"], "ratio_theirs_to_ours": ratios,
                     "all_within_10pct": agreed, "ours_within_slo": within_slo(o),
                     "theirs_within_slo": within_slo(t)})  # fmt: skip
    return rows
