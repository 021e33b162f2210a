"""The default and bare meshes of several `bench/gpu/kv_serving.py` results pooled:
for each rate, each figure's mean over every default run that served that rate
over its mean over every bare run that did, beside the bare runs' own spread
(their largest over their smallest), with how many runs of each kind each rate
had. Rows are matched by rate, so files of different rate lists pool.
`--against OLD.json ...` (the serving gate: one code's default mesh against
another's, run in turn on one machine): the default runs of the files over the
default runs of OLD's, the spread that of OLD's.

Usage: python -m bench.kv_serving_pool RESULT.json ... [--against OLD.json ...]
       [--out POOLED.json] [--prompts N]  (only sweeps of N prompts a rate)"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.gpu.kv_serving_compare import COMPARED, kind_of

KINDS = ("default", "bare")


def runs_by_rate(paths: list[Path], prompts: int | None = None) -> dict[str, dict]:
    """kind -> rate -> the rows of that kind's runs at that rate, over every file."""
    out: dict[str, dict] = {kind: {} for kind in KINDS}
    for path in paths:
        results = json.loads(path.read_text())
        for name, run in results.items():
            kind = kind_of(name)
            if kind not in KINDS or not isinstance(run, dict):
                continue
            for row in run.get("rows", []):
                if (
                    prompts is not None
                    and row.get("completed", 0) + row.get("failed", 0) != prompts
                ):
                    continue
                out[kind].setdefault(row["request_rate"], []).append(row)
    return out


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def pool(ours_by_rate: dict, theirs_by_rate: dict) -> list[dict]:
    """Per rate both have: each figure's mean over `ours` over its mean over `theirs`."""
    table = []
    for rate in sorted(set(ours_by_rate) & set(theirs_by_rate)):
        ours, bare = ours_by_rate[rate], theirs_by_rate[rate]
        row: dict = {"request_rate": rate, "runs": len(ours), "runs_compared": len(bare)}
        for key in COMPARED:
            a, b = _mean(ours, key), _mean(bare, key)
            row[key] = a / b if a is not None and b else None
            values = [r[key] for r in bare if r.get(key)]
            row[f"{key}_spread"] = max(values) / min(values) if len(values) > 1 else None
        table.append(row)
    return table


def print_pooled(table: list[dict]) -> None:
    print("| req/s | runs / compared runs | " + " | ".join(COMPARED) + " |")
    print("|---|---|" + "---|" * len(COMPARED))
    for row in table:
        cells = []
        for key in COMPARED:
            spread = row[f"{key}_spread"]
            cell = f"{row[key]:.3f}" if row[key] is not None else "-"
            cells.append(cell + (f" ({spread:.2f})" if spread else ""))
        print(f"| {row['request_rate']:g} | {row['runs']} / {row['runs_compared']} | "
              + " | ".join(cells) + " |")  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--prompts", type=int)
    parser.add_argument("--against", nargs="+", type=Path)
    args = parser.parse_args(argv)
    ours = runs_by_rate(args.results, args.prompts)
    if args.against:
        table = pool(ours["default"], runs_by_rate(args.against, args.prompts)["default"])
    else:
        table = pool(ours["default"], ours["bare"])
    print_pooled(table)
    if args.out:
        body = {"files": [str(p) for p in args.results], "prompts": args.prompts, "pooled": table,
                "against": [str(p) for p in args.against or []]}  # fmt: skip
        args.out.write_text(json.dumps(body, indent=2) + "\n")
    return table


if __name__ == "__main__":
    main()
