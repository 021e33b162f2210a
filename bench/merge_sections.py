"""One GPU script's results from several calls merged into one file.

A script whose sections together outrun one device call (600 s) runs them in
several calls, each `--skip`ping the others. This writes the file the script
would have written in one: each section's entry from the call that ran it (a
skip or an error only where no call ran it; a later call's run replaces an
earlier call's error; where several calls ran a section, as each runs the
ceilings, the first call's stands and `repeated` names the others), `seconds`
from the calls whose entries stand, and `calls`, each file with the sections it
gave. The header (device, script, preset) must agree.

Usage: python -m bench.merge_sections CALL.json ... --out MERGED.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.gpu.sections import outcome

HEADER = ("device", "script", "preset")


def merge(results: list[tuple[str, dict]]) -> dict:
    """`results`: (name, a call's JSON) in call order; returns the merged JSON."""
    if not results:
        raise ValueError("nothing to merge")
    first = results[0][1]
    merged: dict = {k: first[k] for k in HEADER if k in first}
    merged["seconds"], source = {}, {}
    for name, result in results:
        for key in HEADER:
            if result.get(key) != first.get(key):
                raise ValueError(f"{name}: {key} {result.get(key)!r}, not {first.get(key)!r}")
        for section, seconds in result.get("seconds", {}).items():
            entry, standing = result.get(section), merged.get(section)
            if outcome(entry) == "skipped" and section in merged:
                continue
            if standing is not None and outcome(standing) == "ok":
                if outcome(entry) == "ok":  # the first call's stands (ceilings: every call)
                    merged.setdefault("repeated", {}).setdefault(section, []).append(name)
                continue
            merged[section], merged["seconds"][section] = entry, seconds
            source[section] = name
    merged["calls"] = {
        name: [s for s, n in source.items() if n == name and outcome(merged[s]) != "skipped"]
        for name, _ in results
    }
    return merged


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("calls", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    merged = merge([(p.name, json.loads(p.read_text())) for p in args.calls])
    args.out.write_text(json.dumps(merged, indent=2))
    for name, sections in merged["calls"].items():
        print(f"{name}: {', '.join(sections) or 'nothing'}")
    return merged


if __name__ == "__main__":
    main()
