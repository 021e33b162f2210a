"""What a simulation shows: latency percentiles, the KV hit rate, placement
time, throughput per worker; and the plots that compare runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from yinian.sim.cluster import SimResult
from yinian.sim.worker import itls_ms, ttfts_ms


def pct(values, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def _spread(values) -> dict:
    return {"p50": pct(values, 50), "p90": pct(values, 90), "p99": pct(values, 99),
            "mean": float(np.mean(values)) if len(values) else None}  # fmt: skip


def summary(result: SimResult) -> dict:
    done = result.requests
    ttft, tpot = np.array(ttfts_ms(done)), np.array(itls_ms(done))
    place_us = np.array(result.placement_seconds) * 1e6
    # from arrival until placed: the placements before it, then its own
    placed_ms = np.array([(r.placed - r.arrival) * 1e3 for r in done])
    prompt = sum(w.prompt_tokens for w in result.workers)
    cached = sum(w.cached_tokens for w in result.workers)
    output = sum(w.output_tokens for w in result.workers)
    per_worker = np.array([w.output_tokens for w in result.workers], dtype=float)
    seconds = max(result.end, 1e-9)
    return {
        "workers": len(result.workers),
        "requests_finished": len(done),
        "requests_refused": result.refused,
        "requests_too_long": result.too_long,
        "simulated_seconds": result.end,
        "last_arrival_seconds": result.last_arrival,
        "wall_seconds": result.wall_seconds,
        "ttft_ms": _spread(ttft),
        "tpot_ms": _spread(tpot),
        "kv_hit_rate": cached / prompt if prompt else 0.0,
        "placement_us": _spread(place_us) | {"max": pct(place_us, 100)},
        "until_placed_ms": _spread(placed_ms),
        "output_tokens": output,
        "output_tok_s": output / seconds,
        "output_tok_s_per_worker": output / seconds / len(result.workers),
        # while requests still came (the drain after the last one left out)
        "arrivals_tok_s_per_worker": result.tokens_by_last_arrival
        / max(result.last_arrival, 1e-9)
        / len(result.workers),
        "scheduler_busy": result.scheduler_busy,
        # how evenly the work spread: the busiest worker's tokens over the mean
        "busiest_over_mean": float(per_worker.max() / per_worker.mean())
        if per_worker.mean()
        else None,
        "steps": sum(w.steps for w in result.workers),
    }


def latencies(result: SimResult) -> dict[str, list[float]]:
    return {
        "ttft_ms": sorted(ttfts_ms(result.requests)),
        "worker_output_tokens": sorted(w.output_tokens for w in result.workers),
    }


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> Path:
    for ax in fig.axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def plot(runs: dict[str, dict[str, list[float]]], out_dir: Path) -> list[Path]:
    """TTFT distributions (one line a run) and each run's output tokens per worker."""
    plt = pyplot()
    fig, (ttft_ax, work_ax) = plt.subplots(1, 2, figsize=(12, 4))
    for name, series in runs.items():
        ttft, tokens = series["ttft_ms"], series["worker_output_tokens"]
        if ttft:
            ttft_ax.plot(ttft, np.linspace(0, 1, len(ttft)), label=name)
        if tokens:
            work_ax.plot(np.linspace(0, 1, len(tokens)), tokens, label=name)
    ttft_ax.set_xscale("log")
    ttft_ax.set_xlabel("time to first token (ms, simulated)")
    ttft_ax.set_ylabel("share of requests")
    work_ax.set_xlabel("workers, least to most busy")
    work_ax.set_ylabel("output tokens")
    for ax in (ttft_ax, work_ax):
        ax.legend(fontsize=8)
    return [save(fig, out_dir / "sim.png")]
