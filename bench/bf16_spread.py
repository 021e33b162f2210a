"""How far a 16-bit torch reference parts from the float32 one on the same prompts:
`python -m bench.bf16_spread [--device cpu|cuda] [--presets ...]`.

The engine's torch references (kernels="torch", eager) in float32 and in bfloat16,
on the prompts and token counts bench.gpu.mla's engine sections use: greedy
agreement and prompt-logit distance. It tells what rounding to 16 bits alone
does to a model, so a kernel's distance from the float32 reference can be read
against it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import types
from pathlib import Path

from bench.gpu.engine_checks import Check, _compare
from bench.gpu.mla import CHECKED, GPU, _agreement


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.bf16_spread", description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--presets", nargs="+", default=list(CHECKED))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", help="a JSON file for the comparisons")
    args = parser.parse_args(argv)
    results = {}
    for preset in args.presets:
        section = types.SimpleNamespace(tmp=Path(tempfile.mkdtemp()), device=args.device)
        check = Check(section, preset, GPU["check_lengths"], GPU["check_tokens"])
        found = _compare(*check.reference("float32"), *check.reference(args.dtype))
        results[preset] = found
        print(f"{preset}: torch {args.dtype} against torch float32 on {args.device}: "
              f"{_agreement(found)}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
