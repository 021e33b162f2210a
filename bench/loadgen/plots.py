"""PNG plots of serving benchmark results (matplotlib, Agg: no display needed).

* cdf: empirical CDFs of TTFT, TPOT, ITL and E2E latency of one run; a CDF
  shows the whole distribution, tail included, where a table shows 4 numbers.
* sweep: TTFT and TPOT p50/p99 against request rate, and request and token
  throughput against request rate, one point per run of a sweep.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

_TITLES = {
    "ttft": "Time to first token",
    "tpot": "Time per output token",
    "itl": "Inter-token latency",
    "e2el": "End-to-end latency",
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    return plt


def plot_cdfs(samples: dict[str, list[float]], path: str | Path, title: str = "") -> Path:
    """samples: seconds per metric (ttft, tpot, itl, e2el); plotted in ms."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, name in zip(axes.flat, _TITLES):
        values = np.sort(np.asarray(samples.get(name) or [], dtype=float)) * 1000.0
        if len(values):
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post")
            for q, style in ((50, ":"), (99, "--")):
                ax.axvline(np.percentile(values, q), color="gray", ls=style, label=f"p{q}")
            ax.legend(loc="lower right")
        else:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{_TITLES[name]} ({len(values)} samples)")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _rate_axis(ax, rates: list[float]) -> list[int]:
    # Rates are evenly spaced categories: "inf" has no place on a numeric axis.
    xs = list(range(len(rates)))
    ax.set_xticks(xs, [f"{r:g}" for r in rates])
    ax.set_xlabel("request rate (req/s)")
    ax.grid(alpha=0.3)
    return xs


def plot_sweep(results: list[dict], prefix: str | Path) -> list[Path]:
    """results: one result dict per request rate. Writes PREFIX-latency.png and
    PREFIX-throughput.png."""
    plt = _pyplot()
    rates = [r["request_rate"] for r in results]
    prefix = Path(prefix)
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, name in zip(axes, ("ttft", "tpot")):
        xs = _rate_axis(ax, rates)
        for q, marker in (("median", "o"), ("p99", "s")):
            key = f"{q}_{name}_ms"
            ys = [np.nan if r.get(key) is None else r[key] for r in results]
            ax.plot(xs, ys, marker=marker, label=key)
        ax.set_ylabel("ms")
        ax.set_title(f"{_TITLES[name]} vs request rate")
        ax.legend()
    fig.tight_layout()
    paths.append(prefix.with_name(prefix.name + "-latency.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = _rate_axis(ax, rates)
    ax.plot(xs, [r["output_throughput"] for r in results], marker="o", label="output tok/s")
    ax.plot(xs, [r["total_token_throughput"] for r in results], marker="s", label="total tok/s")
    ax.set_ylabel("tokens/s")
    ax2 = ax.twinx()
    ax2.plot(xs, [r["request_throughput"] for r in results], "g--^", label="requests/s")
    ax2.set_ylabel("requests/s")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left")
    ax.set_title("Throughput vs request rate")
    fig.tight_layout()
    paths.append(prefix.with_name(prefix.name + "-throughput.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
