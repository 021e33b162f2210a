"""How bench/gpu/kv_serving.py compares its meshes: run names (a mesh named again is
`name_2`, ...), each run paired with the bare run of its round, each figure's ratio
to it, and the ratios pooled over repeated rounds beside the bare runs' own spread."""

from __future__ import annotations

import json

COMPARED = ("median_ttft_ms", "p99_ttft_ms", "p99_tpot_ms", "output_throughput")


def kind_of(name: str) -> str:
    """The mesh a run name stands for: `default_2` (its second run) is `default`."""
    base, _, count = name.rpartition("_")
    return base if base and count.isdigit() else name


def run_names(meshes: list[str]) -> list[str]:
    """Each mesh of --meshes under its run name: a repeat is `name_2`, `name_3`, ..."""
    seen: dict[str, int] = {}
    names = []
    for mesh in meshes:
        seen[mesh] = seen.get(mesh, 0) + 1
        names.append(mesh if seen[mesh] == 1 else f"{mesh}_{seen[mesh]}")
    return names


def pairs(names: list[str]) -> list[tuple[str, str]]:
    """(run, the bare run it is compared with): the n-th run of a mesh with the n-th
    bare run (or the last one, with fewer)."""
    bares = [n for n in names if kind_of(n) == "bare"]
    if not bares:
        return []
    rounds: dict[str, int] = {}
    out = []
    for name in names:
        kind = kind_of(name)
        if kind != "bare":
            rounds[kind] = rounds.get(kind, 0) + 1
            out.append((name, bares[min(rounds[kind], len(bares)) - 1]))
    return out


def ratio_key(name: str) -> str:
    """Where a mesh's ratios to the bare mesh are stored in the results."""
    return f"ratio_{name}_to_bare"


def ratios(default: dict, bare: dict) -> list[dict]:
    out = []
    for ours, theirs in zip(default["rows"], bare["rows"]):
        row = {"request_rate": ours["request_rate"]}
        for key in COMPARED:
            a, b = ours.get(key), theirs.get(key)
            row[key] = a / b if a is not None and b else None
        out.append(row)
    return out


def rows_by_rate(runs: dict, prompts: int | None = None,
                 into: dict | None = None) -> dict[str, dict[float, list[dict]]]:  # fmt: skip
    """kind -> rate -> the rows of that kind's runs at that rate (`runs`: run name ->
    its result, as kv_serving writes them; other entries are passed over), added to
    `into`; `prompts`: only sweeps that sent that many prompts a rate."""
    out = into if into is not None else {}
    for name, run in runs.items():
        for row in run.get("rows", []) if isinstance(run, dict) else []:
            if prompts is not None and row.get("completed", 0) + row.get("failed", 0) != prompts:
                continue
            out.setdefault(kind_of(name), {}).setdefault(row["request_rate"], []).append(row)
    return out


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def pool_rates(ours: dict, theirs: dict) -> list[dict]:
    """For each rate both have (rate -> rows): each figure's mean over `ours` over its
    mean over `theirs`, and `theirs`' own spread (largest over smallest: how far two
    runs of one mesh differ), with how many runs each had."""
    table = []
    for rate in sorted(set(ours) & set(theirs)):
        mine, other = ours[rate], theirs[rate]
        row: dict = {"request_rate": rate, "runs": len(mine), "runs_compared": len(other)}
        for key in COMPARED:
            a, b = _mean(mine, key), _mean(other, key)
            row[key] = a / b if a is not None and b else None
            values = [r[key] for r in other if r.get(key)]
            row[f"{key}_spread"] = max(values) / min(values) if len(values) > 1 else None
        table.append(row)
    return table


def pooled(results: dict, names: list[str]) -> dict:
    """Over repeated runs (`--meshes bare,default,bare,default`): for each mesh kind and
    rate, each figure's mean over the kind's runs divided by its mean over the bare runs,
    beside the bare runs' own spread (their largest over their smallest), which says how
    far two runs of one mesh differ."""
    runs = {n: results[n] for n in names if "rows" in (results.get(n) or {})}
    counts: dict[str, int] = {}
    for name in runs:
        counts[kind_of(name)] = counts.get(kind_of(name), 0) + 1
    if counts.get("bare", 0) < 2:
        return {}
    by_kind = rows_by_rate(runs)
    bare = by_kind["bare"]
    out: dict = {"runs": counts}
    out["bare_spread"] = [{"request_rate": r["request_rate"]}
                          | {key: r[f"{key}_spread"] for key in COMPARED}
                          for r in pool_rates(bare, bare)]  # fmt: skip
    for kind, rates in by_kind.items():
        if kind != "bare":
            out[kind] = [{"request_rate": r["request_rate"]} | {key: r[key] for key in COMPARED}
                         for r in pool_rates(rates, bare)]  # fmt: skip
    return out


def print_table(results: dict, names: list[str]) -> None:
    print("| mesh | rate | done | fail | out tok/s | TTFT p50 | TTFT p99 | TPOT p99 |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        for r in (results.get(name) or {}).get("rows", []):
            print(f"| {name} | {r['request_rate']} | {r['completed']} | {r['failed']} | "
                  f"{r['output_throughput']:.0f} | {r['median_ttft_ms']:.1f} | "
                  f"{r['p99_ttft_ms']:.1f} | {r['p99_tpot_ms']:.2f} |")  # fmt: skip
    for name in names:
        r = results.get(name) or {}
        if "rows" in r:
            print(f"{name}: shared tier written {r['shared_written_bytes_per_s'] / 1e6:.1f} MB/s, "
                  f"dropped {r['shared_dropped_blocks']:.0f} blocks "
                  f"{json.dumps(r.get('shared_dropped_by_reason', {}))}, to host "
                  f"{r['host_bytes_to_host'] / 1e6:.0f} MB, 'put failed' lines "
                  f"{r['put_failures_in_logs']}, kernels tuned in the sweep "
                  f"{r.get('kernel_tunings')}, start {r['start_seconds']:.0f} s")  # fmt: skip
    for name, bare in results.get("compared_with", {}).items():
        for row in results.get(ratio_key(name), []):
            cells = ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "request_rate" and v)
            print(f"rate {row['request_rate']}: {name} / {bare}: {cells}")
    pool = results.get("pooled_to_bare") or {}
    for kind, rows in pool.items():
        if kind == "runs":
            continue
        for row in rows:
            cells = ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "request_rate" and v)
            label = "bare runs' spread" if kind == "bare_spread" else f"pooled {kind} / bare"
            print(f"rate {row['request_rate']}: {label} ({pool['runs']}): {cells}")
