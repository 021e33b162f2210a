"""Each mesh kind's requests pooled over its runs (bench/gpu/kv_serving.py): TTFT
p50 and p99 and TPOT p99 over every request of every run of a kind at one rate,
and each kind's over the bare runs'. A p99 over four runs of 320 requests is
their 13th slowest of 1,280, where a run's own p99 is its 4th slowest: steadier
than the mean of the runs' p99s, and what a user of the mesh over those runs
would have seen. Read from the per-request files `bench serve` writes
(`NAME-rateR.json` for a sweep, `NAME.json` for one rate), with its definitions
(TPOT: a request's time after its first token over its further tokens)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.gpu.kv_serving_compare import kind_of
from bench.loadgen.metrics import latency_stats

FIGURES = ("median_ttft_ms", "p99_ttft_ms", "p99_tpot_ms")


def request_file(out_dir: Path, name: str, rate: float) -> Path:
    """Where `bench serve --result-filename NAME` put one rate's requests."""
    sweep = Path(out_dir) / f"{name}-rate{rate:g}.json"
    return sweep if sweep.exists() else Path(out_dir) / f"{name}.json"


def request_figures(data: dict) -> tuple[list[float], list[float]]:
    """(TTFT s, TPOT s) of each request that succeeded (TPOT of those with more than
    one token)."""
    ttfts, tpots = [], []
    for ttft, e2el, out, error in zip(
        data["ttfts"], data["e2els"], data["output_lens"], data["errors"]
    ):
        if error or ttft is None:
            continue
        ttfts.append(ttft)
        if out > 1:
            tpots.append((e2el - ttft) / (out - 1))
    return ttfts, tpots


def _figures(ttfts: list[float], tpots: list[float]) -> dict:
    ttft, tpot = latency_stats("ttft", ttfts, [99]), latency_stats("tpot", tpots, [99])
    return {"requests": len(ttfts)} | {k: (ttft | tpot)[k] for k in FIGURES}


def pooled_requests(out_dir: Path, names: list[str], rates: list[float]) -> dict:
    """{kind: rows}, a row per rate with the pooled figures and the request count,
    and {kind}_to_bare: each figure's ratio to the bare runs' (where there are any).
    Runs whose file for a rate is missing are left out of that rate."""
    kinds: dict[str, list[str]] = {}
    for name in names:
        kinds.setdefault(kind_of(name), []).append(name)
    out: dict = {}
    for kind, runs in kinds.items():
        rows = []
        for rate in rates:
            ttfts, tpots = [], []
            for name in runs:
                path = request_file(out_dir, name, rate)
                data = json.loads(path.read_text()) if path.exists() else {}
                if data and float(data.get("request_rate", rate)) == rate:
                    a, b = request_figures(data)
                    ttfts += a
                    tpots += b
            rows.append({"request_rate": rate} | _figures(ttfts, tpots))
        out[kind] = rows
    bare = out.get("bare")
    if bare:
        for kind in [k for k in out if k != "bare"]:
            out[f"{kind}_to_bare"] = [
                {"request_rate": ours["request_rate"]}
                | {
                    f: ours[f] / theirs[f] if ours[f] is not None and theirs[f] else None
                    for f in FIGURES
                }
                for ours, theirs in zip(out[kind], bare)
            ]
    return out


def print_pooled_requests(pool: dict) -> None:
    for kind, rows in pool.items():
        for row in rows:
            cells = ", ".join(
                f"{k} {v:.3f}" if kind.endswith("_to_bare") else f"{k} {v:.1f}"
                for k, v in row.items()
                if k not in ("request_rate", "requests") and v is not None
            )
            count = f" ({row['requests']} requests)" if "requests" in row else ""
            print(f"rate {row['request_rate']}: every request of {kind}{count}: {cells}")
