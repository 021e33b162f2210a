"""The engine alone: is a device hit's greedy answer the recompute's, and what
does the host tier's way of backing up cost the hit's time?

One 8k-token prompt (llama3-8b, bf16, dummy weights) through four engines in
turn: prefix caching off (the reference: every run a whole prefill), and
prefix caching on with the host tier backing up blocks by the kernel
(`kernels/host_blocks.py`, the CUDA default), by the copy engine
(`YINIAN_HOST_COPY=engine`), or with no host tier. Each: the first run (a
recompute) and REPEATS device hits, their first token's time (one token asked)
and their greedy tokens (TOKENS asked), each compared with the reference's.

Usage: python -m bench.gpu.hit_check --out bench/results/hit_check.json [--device cpu]
Sections: ceilings, reference, kernel, engine, no_host.
"""

from __future__ import annotations

import os
import time

from bench.gpu import ceilings
from bench.gpu.models import preset_folder
from bench.gpu.sections import Sections, script_parser
from bench.loadgen.datasets import load_tokenizer, random_requests
from engine import LLM, SamplingParams

REPEATS, TOKENS = 3, 16
GPU = dict(preset="llama3-8b", dtype="bfloat16", prompt=8192, host_gb=16.0, load="dummy")
DRY = dict(preset="tiny-llama", dtype="float32", prompt=300, host_gb=0.02, load="auto")
MODES = {  # section: (prefix caching, host tier GB or None for the setup's, YINIAN_HOST_COPY)
    "reference": (False, 0.0, None),
    "kernel": (True, None, "kernel"),
    "engine": (True, None, "engine"),
    "no_host": (True, 0.0, None),
}


def run_mode(folder: str, setup: dict, device: str, mode: str, prompt, warm) -> dict:
    caching, host_gb, copy = MODES[mode]
    if copy is None:
        os.environ.pop("YINIAN_HOST_COPY", None)
    else:
        os.environ["YINIAN_HOST_COPY"] = copy
    llm = LLM(folder, dtype=setup["dtype"], device=device, load_format=setup["load"],
              enable_prefix_caching=caching,
              host_kv_cache_gb=setup["host_gb"] if host_gb is None else host_gb)  # fmt: skip
    try:
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        many = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)

        def timed(ids) -> float:
            start = time.perf_counter()
            llm.generate([ids], one)
            return (time.perf_counter() - start) * 1e3

        timed(warm)  # the shapes, warmed up
        first_ms = timed(prompt)
        hits_ms = [timed(prompt) for _ in range(REPEATS)]
        answers = [list(llm.generate([prompt], many)[0].outputs[0].token_ids)
                   for _ in range(REPEATS)]  # fmt: skip
        return {"first_ms": first_ms, "hits_ms": hits_ms, "answers": answers}
    finally:
        llm.close()
        os.environ.pop("YINIAN_HOST_COPY", None)


def main(argv=None) -> dict:
    args = script_parser(__doc__).parse_args(argv)
    setup = GPU if args.device == "cuda" else DRY
    with Sections(args, script="hit_check", preset=setup["preset"]) as section:
        device = section.device
        folder, _ = preset_folder(section.tmp, setup["preset"])
        section("ceilings", lambda: ceilings.measure(device))
        tok = load_tokenizer(folder)
        prompt, warm = [r.prompt for r in random_requests(
            tok, 2, setup["prompt"], 4, seed=7, prompt_format="ids")]  # fmt: skip
        for mode in MODES:
            section(mode, lambda mode=mode: run_mode(str(folder), setup, device, mode,
                                                     prompt, warm))  # fmt: skip
        results = section.results
        ref = (results.get("reference") or {}).get("answers", [None])[0]
        for mode in MODES:
            r = results.get(mode) or {}
            if "answers" not in r:
                continue
            same = [a == ref for a in r["answers"]]
            first_diff = [next((i for i, (x, y) in enumerate(zip(a, ref or [])) if x != y), None)
                          for a in r["answers"]]  # fmt: skip
            r["same_as_reference"], r["first_differing_token"] = same, first_diff
            print(f"{mode:10s} first {r['first_ms']:7.1f} ms, hits "
                  f"{', '.join(f'{m:.1f}' for m in r['hits_ms'])} ms, same as reference {same} "
                  f"(first differing token {first_diff})")  # fmt: skip
        return results


if __name__ == "__main__":
    main()
