"""Async scheduling on the GPU: the same workload with it off and on, in one
engine (kernels, CUDA graphs, bf16), must give the same tokens and logprobs;
and the wall time of each.

The workload mixes greedy requests with logprobs and seeded sampled ones, with
prompt and output lengths spread so the batch shrinks step by step. No request
stops on a token: a stop makes the async engine run one extra step for that
sequence, which changes the next batches' composition and so, on a GPU, the
kernels' split choices and rounding. Prefix caching is off so that the second
run computes what the first did. Stop tokens, stop strings, penalties, forks
and aborts under async scheduling are covered by tests/test_async_scheduling.py.

Usage: python -m bench.async_scheduling_gpu --out DIR [--presets tiny-qwen3 llama3-8b]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.engine_kernels_check import release
from engine import LLM, SamplingParams
from engine.make_model import TINY_PRESETS, preset_config, write_model


def workload(vocab: int, n: int = 48, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 1500, (n,), generator=g).tolist()
    prompts = [torch.randint(0, min(vocab, 30000), (k,), generator=g).tolist() for k in lengths]
    params = []
    for i in range(n):
        max_tokens = 8 + (i * 37) % 120
        if i % 3 == 0:
            params.append(SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        elif i % 3 == 1:
            params.append(
                SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)
            )
        else:
            params.append(
                SamplingParams(
                    max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True
                )
            )
    return prompts, params


def _summary(out):
    c = out.outputs[0]
    lps = [{t: round(lp.logprob, 6) for t, lp in e.items()} for e in c.logprobs or []]
    return c.token_ids, lps


def compare(preset: str, tmp: Path, device: str = "cuda", n: int = 48) -> dict:
    config = preset_config(preset)
    dummy = preset not in TINY_PRESETS
    folder = write_model(tmp / preset, config, weights=not dummy, seed=1)
    llm = LLM(folder, dtype="bfloat16", device=device, load_format="dummy" if dummy else "auto",
              enable_prefix_caching=False, max_model_len=4096, warmup=False)  # fmt: skip
    prompts, params = workload(llm.engine.model_config.vocab_size, n)
    sync_device = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    runs = {}
    for mode in (False, True, False, True):  # twice each: the second is timed cleanly
        llm.engine.async_scheduling = mode
        sync_device()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        sync_device()
        runs[mode] = (time.perf_counter() - start, [_summary(o) for o in outs])
    (t_sync, sync), (t_async, fast) = runs[False], runs[True]
    equal = [a == b for a, b in zip(sync, fast)]
    n_out = sum(len(t) for t, _ in sync)
    result = {
        "preset": preset,
        "requests": len(prompts),
        "output_tokens": n_out,
        "outputs_equal": sum(equal),
        "first_unequal": equal.index(False) if not all(equal) else None,
        "sync_s": t_sync,
        "async_s": t_async,
        "sync_output_tok_s": n_out / t_sync,
        "async_output_tok_s": n_out / t_async,
        "kv_blocks_used_after": llm.get_stats()["kv_blocks_used"],
    }
    release(llm)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--presets", nargs="*", default=["tiny-qwen3", "llama3-8b"])
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script")
    parser.add_argument("--requests", type=int, default=48)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp())
    results = [compare(p, tmp, args.device, args.requests) for p in args.presets]
    (out / "async_scheduling.json").write_text(json.dumps(results, indent=2))
    print("| model | requests | equal outputs | sync s | async s | out tok/s sync -> async |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['preset']} | {r['requests']} | {r['outputs_equal']}/{r['requests']} | "
              f"{r['sync_s']:.2f} | {r['async_s']:.2f} | {r['sync_output_tok_s']:.0f} -> "
              f"{r['async_output_tok_s']:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
