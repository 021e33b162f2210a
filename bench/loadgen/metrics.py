"""Serving metrics from per-request results, defined as `vllm bench serve` defines them.

* Only successful requests enter latency and token statistics; failures are
  counted, and their error bodies reported, but never averaged in.
* TTFT: first content chunk. E2EL: the whole request. ITL: every gap between
  content chunks, pooled over all requests.
* TPOT = (E2EL - TTFT) / (output_tokens - 1), only for requests with more than
  one output token (for goodput such a request has TPOT 0, as in vLLM).
* Goodput: successful requests per second that meet every given SLO (ms).
* Throughputs divide by the benchmark's wall-clock duration.
"""

from __future__ import annotations

import numpy as np

from bench.loadgen.client import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {SLO_METRICS}, got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {item!r}: SLOs must be >= 0 ms")
    return slos


def nearest_rank(values: list[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) as one of the values: the one at rank q * n of the
    sorted n (the last for q = 1). Unlike latency_stats' percentiles, no interpolation."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency_stats(name: str, values_s: list[float], percentiles: list[float]) -> dict:
    """mean/median/std/percentiles in ms; None (null) when there is no sample, so that
    a run where everything failed can never read as a fast one."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"]
    keys += [f"p{p:g}_{name}_ms" for p in percentiles]
    if not values_s:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s, dtype=float) * 1000.0
    values = [ms.mean(), np.median(ms), ms.std()] + [np.percentile(ms, p) for p in percentiles]
    return {k: float(v) for k, v in zip(keys, values)}


def _peaks(results: list[RequestResult], t0: float) -> tuple[float, int]:
    """Peak output tokens in any one-second window bucket, and peak in-flight requests."""
    token_times, events = [], []
    for r in results:
        start = r.start_time - t0
        events += [(start, 1), (start + r.latency, -1)]
        if r.success:
            t = start + r.ttft
            stamps = [t]
            for gap in r.itl:
                t += gap
                stamps.append(t)
            token_times += stamps
    peak_tps = 0.0
    if token_times:
        buckets = np.bincount(np.floor(np.asarray(token_times)).astype(int))
        peak_tps = float(buckets.max())
    running = peak = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):  # ends before starts on ties
        running += delta
        peak = max(peak, running)
    return peak_tps, peak


def offered_rate(start_times: list[float]) -> float | None:
    """Requests a second as they were sent: the gaps between the first and the last send
    over the time between them (a client's schedule, not the server's pace)."""
    if len(start_times) < 2 or max(start_times) <= min(start_times):
        return None
    return (len(start_times) - 1) / (max(start_times) - min(start_times))


def compute_metrics(
    results: list[RequestResult],
    duration_s: float,
    percentiles: list[float] = (50, 90, 99),
    goodput: dict[str, float] | None = None,
    t0: float | None = None,
) -> dict:
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    itls = [gap for r in ok for gap in r.itl]
    tpots, all_tpots = [], []
    for r in ok:
        tpot = 0.0
        if r.output_tokens > 1:
            tpot = (r.latency - r.ttft) / (r.output_tokens - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)

    good = 0
    if goodput:
        per_metric = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        for i in range(len(ok)):
            if all(per_metric[m][i] * 1000.0 <= slo for m, slo in goodput.items()):
                good += 1

    dur = max(duration_s, 1e-9)
    t0 = min((r.start_time for r in results), default=0.0) if t0 is None else t0
    peak_tps, peak_conc = _peaks(results, t0)
    out = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "offered_rate": offered_rate([r.start_time for r in results]),
        "request_throughput": len(ok) / dur,
        "request_goodput": good / dur if goodput else None,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "max_output_tokens_per_s": peak_tps,
        "max_concurrent_requests": peak_conc,
    }
    series = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name in METRICS:
        out.update(latency_stats(name, series[name], list(percentiles)))
    return out


def per_request(results: list[RequestResult], t0: float) -> dict[str, list]:
    """Per-request arrays for the JSON (vLLM's names where it has them)."""
    return {
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": [r.output_tokens if r.success else 0 for r in results],
        "ttfts": [r.ttft if r.success else None for r in results],
        "e2els": [r.latency if r.success else None for r in results],
        "itls": [r.itl if r.success else [] for r in results],
        "start_times": [r.start_time - t0 for r in results],
        "status_codes": [r.status_code for r in results],
        "errors": [r.error for r in results],
        "cached_tokens": [r.cached_tokens if r.success else 0 for r in results],
        "generated_texts": [r.generated_text if r.success else None for r in results],
    }


def latency_samples(results: list[RequestResult]) -> dict[str, list[float]]:
    """Seconds per metric over successful requests, for the CDF plots."""
    ok = [r for r in results if r.success]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
