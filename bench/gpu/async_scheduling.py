"""Async scheduling on the GPU: the same workload with it off and on, in one
engine (kernels, CUDA graphs, bf16), must give the same tokens and logprobs;
and the wall time of each.

The workload mixes greedy requests with logprobs and seeded sampled ones, with
prompt and output lengths spread so the batch shrinks step by step. No request
stops on a token: a stop makes the async engine run one extra step for that
sequence, which changes the next batches' composition and so, on a GPU, the
kernels' split choices and rounding. Prefix caching is off so that the second
run computes what the first did. Stop tokens, stop strings, penalties, forks
and aborts under async scheduling are covered by tests/engine/test_async_scheduling.py.

Usage: python -m bench.gpu.async_scheduling --out bench/results/async_scheduling.json
           [--presets tiny-qwen3 llama3-8b] [--requests N]
One section per preset; prints a table last.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from bench.gpu.models import preset_folder
from bench.gpu.sections import Sections, script_parser
from engine import LLM, SamplingParams


@dataclasses.dataclass(frozen=True)
class Workload:
    presets: tuple[str, ...]
    requests: int
    max_prompt: int
    max_output: int


GPU = Workload(("tiny-qwen3", "llama3-8b"), 48, 1500, 127)
DRY = Workload(("tiny-qwen3",), 6, 40, 12)


def workload(vocab: int, w: Workload, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, w.max_prompt, (w.requests,), generator=g).tolist()
    prompts = [torch.randint(0, min(vocab, 30000), (k,), generator=g).tolist() for k in lengths]
    params = []
    for i in range(w.requests):
        max_tokens = 8 + (i * 37) % (w.max_output - 7)
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


def compare(section: Sections, preset: str, w: Workload) -> dict:
    folder, load_format = preset_folder(section.tmp, preset)
    llm = LLM(folder, dtype="bfloat16", device=section.device, load_format=load_format,
              kernels="auto" if section.cuda else "torch", enable_prefix_caching=False,
              max_model_len=4096, warmup=False)  # fmt: skip
    try:
        prompts, params = workload(llm.engine.model_config.vocab_size, w)
        sync = torch.cuda.synchronize if section.cuda else (lambda: None)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
        runs = {}
        for mode in (False, True, False, True):  # twice each: the second is timed cleanly
            llm.engine.async_scheduling = mode
            sync()
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            sync()
            runs[mode] = (time.perf_counter() - start, [_summary(o) for o in outs])
        kv_blocks_used = llm.get_stats()["kv_blocks_used"]
    finally:
        llm.close()
    (t_sync, plain), (t_async, ahead) = runs[False], runs[True]
    equal = [a == b for a, b in zip(plain, ahead)]
    n_out = sum(len(t) for t, _ in plain)
    return {
        "preset": preset,
        "requests": len(prompts),
        "output_tokens": n_out,
        "outputs_equal": sum(equal),
        "first_unequal": equal.index(False) if not all(equal) else None,
        "sync_s": t_sync,
        "async_s": t_async,
        "sync_output_tok_s": n_out / t_sync,
        "async_output_tok_s": n_out / t_async,
        "kv_blocks_used_after": kv_blocks_used,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--presets", nargs="+")
    parser.add_argument("--requests", type=int)
    args = parser.parse_args(argv)
    w = GPU if args.device == "cuda" else DRY
    w = dataclasses.replace(w, presets=tuple(args.presets or w.presets),
                            requests=args.requests or w.requests)  # fmt: skip
    with Sections(args, script="async_scheduling") as section:
        for preset in w.presets:
            section(preset, lambda p=preset: compare(section, p, w))
        print("| model | requests | equal outputs | sync s | async s | out tok/s sync -> async |")
        print("|---|---|---|---|---|---|")
        for r in (section.results.get(p) for p in w.presets):
            if isinstance(r, dict) and "preset" in r:
                print(f"| {r['preset']} | {r['requests']} | {r['outputs_equal']}/{r['requests']} "
                      f"| {r['sync_s']:.2f} | {r['async_s']:.2f} | {r['sync_output_tok_s']:.0f} "
                      f"-> {r['async_output_tok_s']:.0f} |")  # fmt: skip
        return section.results


if __name__ == "__main__":
    main()
