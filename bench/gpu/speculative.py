"""Speculative decoding at batch 1 on one GPU: decode tokens/s with ngram and with
trie drafts (k = 4) against none, on the default model (pydoc-llama) and on
llama3-8b with dummy weights, beside the batch-1 bandwidth floor (the weights'
bytes read once a token at the measured copy bandwidth) of the same run.

Cases, each one request at a time, greedy:
- quoting: the default model asked to repeat a code example it was shown
  (bench/speculative_acceptance.py's "code edit" prompts);
- random: a prompt of random tokens (drafts rarely proposed);
- repeating: a 64-token segment repeated (drafts proposed every step from the
  prompt; kept where the model repeats too);
- again: each prompt served once before it is timed (trie drafts then follow
  the first answer; prompt lookup cannot see it).
The time of a request's decode is its time less that of the same request's first
token (measured alone); outputs with drafts are checked equal to those without, and
where one differs, the gap there between the two likeliest tokens without drafts is
reported (in bf16 a near-tie can fall either way between a verify pass and a decode).

Usage: python -m bench.gpu.speculative --out bench/results/speculative.json
           [--device cpu] [--tokens 128] [--k 4] [--dtype bfloat16]
"""

from __future__ import annotations

import time

import torch

from basis.model_config import ModelConfig
from bench.gpu import ceilings
from bench.gpu.engine_rates import random_prompts, sync
from bench.gpu.models import preset_folder
from bench.gpu.sections import Sections, script_parser
from bench.speculative_acceptance import quoting_prompts
from engine import LLM, SamplingParams
from yinian.default_model import ensure_default_model


def engine(section: Sections, folder, load_format: str, speculative: dict, dtype: str) -> LLM:
    return LLM(folder, dtype=dtype, device=section.device,
               load_format=load_format, max_num_seqs=8,
               gpu_memory_utilization=0.85 if dtype == "float32" else 0.4,
               **speculative)  # fmt: skip


def timed(llm: LLM, prompt, tokens: int) -> tuple[float, list[int]]:
    sync(llm)
    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    sync(llm)
    return time.perf_counter() - start, out[0].outputs[0].token_ids


def decode_rate(llm: LLM, prompts: list, tokens: int, again: bool) -> dict:
    """Batch-1 decode tokens/s over the prompts (each one alone), and the drafts kept.
    `again`: each prompt is served once, untimed, before it is timed (a repeated request)."""
    warm = "Warm up." if isinstance(prompts[0], str) else list(range(2, 34))
    timed(llm, warm, 8)  # graphs and kernels (another prompt: the trie learns what it serves)
    stats = llm.get_stats()
    decode_s, outputs = 0.0, []
    for prompt in prompts:
        if again:
            timed(llm, prompt, tokens)
        first, _ = timed(llm, prompt, 1)
        whole, ids = timed(llm, prompt, tokens)
        decode_s += max(whole - first, 1e-9)
        outputs.append(ids)
    after = llm.get_stats()
    drafted = after.get("spec_draft_tokens", 0) - stats.get("spec_draft_tokens", 0)
    kept = after.get("spec_accepted_tokens", 0) - stats.get("spec_accepted_tokens", 0)
    return {"tokens_per_s": len(prompts) * (tokens - 1) / decode_s, "draft_tokens": drafted,
            "accepted_tokens": kept, "outputs": outputs}  # fmt: skip


MODES = ("off", "ngram", "trie")


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (the shorter one's length if one
    is the other's start), None if they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def top2_gap(llm: LLM, prompt, position: int, off: list[int], on: list[int]) -> dict:
    """Without drafts, at `position` of the greedy answer: the two likeliest tokens'
    logprobs and their gap. A gap within the dtype's rounding is a near-tie that the
    verify pass (several positions in one pass, another summation order) can flip.
    `same_as_off`: this answer equals the timed run's without drafts (`off`) up to and at
    `position` (else the gap is of another context); the logprob here of the token the
    run with drafts (`on`) chose there."""
    params = SamplingParams(max_tokens=position + 1, temperature=0, ignore_eos=True, logprobs=2)
    out = llm.generate([prompt], params)[0].outputs[0]
    ranked = sorted(out.logprobs[position].values(), key=lambda v: -v.logprob)[:2]
    chosen = out.logprobs[position].get(on[position]) if position < len(on) else None
    return {"position": position, "token": out.token_ids[position],
            "top2_logprobs": [v.logprob for v in ranked],
            "gap": ranked[0].logprob - ranked[1].logprob,
            "same_as_off": out.token_ids == off[: position + 1],
            "drafts_token": on[position] if position < len(on) else None,
            "drafts_token_logprob": None if chosen is None else chosen.logprob}  # fmt: skip


def divergences(
    section: Sections, folder, load_format: str, cases: dict, rows: dict, dtype: str
) -> dict:
    """For each output with drafts that differs from its output without: where, and
    the gap there without drafts (one more engine without drafts, only if any differ)."""
    found = {(case, mode, i): at for mode in MODES[1:] for case in cases
             for i, (off, on) in enumerate(zip(rows["off"][case]["outputs"],
                                               rows[mode][case]["outputs"]))
             if (at := first_difference(off, on)) is not None}  # fmt: skip
    if not found:
        return {}
    llm = engine(section, folder, load_format, {}, dtype)
    try:
        out: dict = {}
        for (case, mode, i), at in found.items():
            off, on = rows["off"][case]["outputs"][i], rows[mode][case]["outputs"][i]
            gap = top2_gap(llm, cases[case][0][i], at, off, on)
            out.setdefault(case, {}).setdefault(mode, []).append({"prompt": i, **gap})
        return out
    finally:
        llm.close()


def compare(section: Sections, name: str, folder, load_format: str, cases: dict, tokens: int,
            k: int, ceiling: dict, dtype: str) -> dict:  # fmt: skip
    """Each case (prompts, whether each is served once before it is timed) with
    speculation off, ngram and trie."""
    rows = {}
    for mode in MODES:
        options = {} if mode == "off" else {"speculative_method": mode,
                                            "num_speculative_tokens": k}  # fmt: skip
        llm = engine(section, folder, load_format, options, dtype)
        try:
            rows[mode] = {case: decode_rate(llm, texts, tokens, again)
                          for case, (texts, again) in cases.items()}  # fmt: skip
            weight_bytes = llm.engine.runner.weight_bytes
        finally:
            llm.close()
    differ = divergences(section, folder, load_format, cases, rows, dtype)
    floor = ceiling.get("copy_gbps", 0) * 1e9 / weight_bytes
    out = {"model": name, "weight_bytes": weight_bytes, "batch1_floor_tokens_per_s": floor}
    for case in cases:
        off = rows["off"][case]
        out[case] = {"off_tokens_per_s": off["tokens_per_s"],
                     "off_vs_floor": off["tokens_per_s"] / floor if floor else None}  # fmt: skip
        for mode in MODES[1:]:
            on = rows[mode][case]
            out[case][mode] = {
                "tokens_per_s": on["tokens_per_s"],
                "speedup": on["tokens_per_s"] / off["tokens_per_s"],
                "draft_tokens": on["draft_tokens"], "accepted_tokens": on["accepted_tokens"],
                "equal_outputs": on["outputs"] == off["outputs"],
                "differences": differ.get(case, {}).get(mode, []),
            }  # fmt: skip
            for d in out[case][mode]["differences"]:
                lp = d["drafts_token_logprob"]
                chosen = "out of the top 2" if lp is None else f"logprob {lp:.4f}"
                other = "" if d["same_as_off"] else "; not the timed answer without drafts"
                print(f"  prompt {d['prompt']}: differs from token {d['position']}, where "
                      f"the two likeliest tokens without drafts are {d['gap']:.4f} apart "
                      f"in logprob (the token chosen with drafts: {chosen}{other})")  # fmt: skip
            print(f"{name:10} {case:10} {mode:5} off {off['tokens_per_s']:8.1f} tok/s, on "
                  f"{on['tokens_per_s']:8.1f} ({out[case][mode]['speedup']:.2f}x), kept "
                  f"{on['accepted_tokens']} of {on['draft_tokens']} drafts, equal "
                  f"{out[case][mode]['equal_outputs']}", flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=None, help="output tokens a request")
    parser.add_argument("--k", type=int, default=4, help="drafts a step")
    parser.add_argument("--dtype", default=None, help="bfloat16 on a GPU, float32 on the CPU")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    tokens = args.tokens or (128 if cuda else 12)
    count = 4 if cuda else 1
    big = "llama3-8b" if cuda else "tiny-llama"
    with Sections(args, script="speculative", k=args.k, tokens=tokens, dtype=dtype) as section:
        ceiling = section("ceilings", lambda: ceilings.measure(section.device)) or {}
        default = str(ensure_default_model())
        quoting = quoting_prompts(count)
        cases = {"quoting": (quoting["code edit"], False), "again": (quoting["summary"], True)}
        section("default", lambda: compare(section, "pydoc-llama", default, "auto", cases,
                                           tokens, args.k, ceiling, dtype))  # fmt: skip

        def big_model() -> dict:
            folder, load_format = preset_folder(section.tmp, big)
            vocab = ModelConfig.from_pretrained(folder).vocab_size
            segment = random_prompts(1, 64, vocab, seed=5)[0]
            cases = {"random": (random_prompts(count, 512, vocab, seed=3), False),
                     "repeating": ([segment * 8] * count, False),
                     "again": (random_prompts(count, 512, vocab, seed=4), True)}  # fmt: skip
            return compare(section, big, folder, load_format, cases, tokens, args.k, ceiling,
                           dtype)  # fmt: skip

        section(big, big_model)
        if cuda:
            torch.cuda.empty_cache()
        return section.results


if __name__ == "__main__":
    main()
