"""The default and bare meshes of several `bench/gpu/kv_serving.py` results pooled:
for each rate, each figure's mean over every default run that served that rate
over its mean over every bare run that did, beside the bare runs' own spread
(their largest over their smallest), with how many runs of each kind each rate
had. Rows are matched by rate, so files of different rate lists pool.
`--against OLD.json ...` (the serving gate: one code's default mesh against
another's, run in turn on one machine): the default runs of the files over the
default runs of OLD's, the spread that of OLD's. `--requests FOLDER`: every
request of the per-request files there (`bench serve`'s, named after their runs:
`default.json`, `bare_2.json`, `bare-rate16.json`) pooled by mesh kind and rate
(bench/gpu/kv_serving_requests.py), for runs of several calls.

Usage: python -m bench.kv_serving_pool [RESULT.json ...] [--against OLD.json ...]
       [--out POOLED.json] [--prompts N]  (only sweeps of N prompts a rate)
       [--requests FOLDER]"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.gpu.kv_serving_compare import COMPARED, pool_rates, rows_by_rate
from bench.gpu.kv_serving_requests import pooled_requests, print_pooled_requests


def runs_by_rate(paths: list[Path], prompts: int | None = None) -> dict[str, dict]:
    """kind -> rate -> the rows of that kind's runs at that rate, over every file."""
    out: dict[str, dict] = {}
    for path in paths:
        rows_by_rate(json.loads(path.read_text()), prompts, into=out)
    return out


def request_runs(folder: Path) -> tuple[list[str], list[float]]:
    """The run names and the rates of the per-request files in a folder (warm-ups left
    out)."""
    names, rates = set(), set()
    for path in folder.glob("*.json"):
        name = path.stem.split("-rate")[0]
        rate = json.loads(path.read_text()).get("request_rate")
        if not name.endswith("-warmup") and rate is not None:  # (not a per-request file)
            names.add(name)
            rates.add(float(rate))
    return sorted(names), sorted(rates)


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
    parser.add_argument("results", nargs="*", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--prompts", type=int)
    parser.add_argument("--against", nargs="+", type=Path)
    parser.add_argument("--requests", type=Path, help="a folder of per-request files")
    args = parser.parse_args(argv)
    if not args.results and not args.requests:
        parser.error("give result files, --requests FOLDER or both")
    ours = runs_by_rate(args.results, args.prompts)
    theirs = runs_by_rate(args.against, args.prompts) if args.against else ours
    table = pool_rates(
        ours.get("default", {}), theirs.get("default" if args.against else "bare", {})
    )
    if table:
        print_pooled(table)
    requests = None
    if args.requests:
        requests = pooled_requests(args.requests, *request_runs(args.requests))
        print_pooled_requests(requests)
    if args.out:
        body = {"files": [str(p) for p in args.results], "prompts": args.prompts, "pooled": table,
                "against": [str(p) for p in args.against or []]}  # fmt: skip
        if requests is not None:
            body |= {"requests_folder": str(args.requests), "requests": requests}
        args.out.write_text(json.dumps(body, indent=2) + "\n")
    return table


if __name__ == "__main__":
    main()
