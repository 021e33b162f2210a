"""Speculative decoding at batch 1 on one GPU: decode tokens/s with n-gram drafts
(k = 4) against none, on the default model (pydoc-llama) and on llama3-8b with
dummy weights, beside the batch-1 bandwidth floor (the weights' bytes read once
a token at the measured copy bandwidth) of the same run.

Cases, each one request at a time, greedy:
- quoting: the default model asked to repeat a code example it was shown
  (bench/speculative_acceptance.py's "code edit" prompts);
- random: a prompt of random tokens (drafts rarely proposed);
- repeating: a 64-token segment repeated (drafts proposed every step from the
  prompt; kept where the model repeats too).
The time of a request's decode is its time less that of the same request's first
token (measured alone); outputs with drafts are checked equal to those without.

Usage: python -m bench.gpu.speculative --out bench/results/speculative.json
           [--device cpu] [--tokens 128] [--k 4]
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


def engine(section: Sections, folder, load_format: str, speculative: dict) -> LLM:
    return LLM(folder, dtype="bfloat16" if section.cuda else "float32", device=section.device,
               load_format=load_format, gpu_memory_utilization=0.4, max_num_seqs=8,
               **speculative)  # fmt: skip


def timed(llm: LLM, prompt, tokens: int) -> tuple[float, list[int]]:
    sync(llm)
    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    sync(llm)
    return time.perf_counter() - start, out[0].outputs[0].token_ids


def decode_rate(llm: LLM, prompts: list, tokens: int) -> dict:
    """Batch-1 decode tokens/s over the prompts (each one alone), and the drafts kept."""
    timed(llm, prompts[0], 8)  # warm-up: graphs, kernels
    stats = llm.get_stats()
    decode_s, outputs = 0.0, []
    for prompt in prompts:
        first, _ = timed(llm, prompt, 1)
        whole, ids = timed(llm, prompt, tokens)
        decode_s += max(whole - first, 1e-9)
        outputs.append(ids)
    after = llm.get_stats()
    drafted = after.get("spec_draft_tokens", 0) - stats.get("spec_draft_tokens", 0)
    kept = after.get("spec_accepted_tokens", 0) - stats.get("spec_accepted_tokens", 0)
    return {"tokens_per_s": len(prompts) * (tokens - 1) / decode_s, "draft_tokens": drafted,
            "accepted_tokens": kept, "outputs": outputs}  # fmt: skip


def compare(section: Sections, name: str, folder, load_format: str, cases: dict, tokens: int,
            k: int, ceiling: dict) -> dict:  # fmt: skip
    rows = {}
    for mode, options in (("off", {}), ("ngram", {"speculative_method": "ngram",
                                                  "num_speculative_tokens": k})):  # fmt: skip
        llm = engine(section, folder, load_format, options)
        try:
            rows[mode] = {case: decode_rate(llm, texts, tokens) for case, texts in cases.items()}
            weight_bytes = llm.engine.runner.weight_bytes
        finally:
            llm.close()
    floor = ceiling.get("copy_gbps", 0) * 1e9 / weight_bytes
    out = {"model": name, "weight_bytes": weight_bytes, "batch1_floor_tokens_per_s": floor}
    for case in cases:
        off, on = rows["off"][case], rows["ngram"][case]
        out[case] = {
            "off_tokens_per_s": off["tokens_per_s"], "ngram_tokens_per_s": on["tokens_per_s"],
            "speedup": on["tokens_per_s"] / off["tokens_per_s"],
            "off_vs_floor": off["tokens_per_s"] / floor if floor else None,
            "draft_tokens": on["draft_tokens"], "accepted_tokens": on["accepted_tokens"],
            "equal_outputs": on["outputs"] == off["outputs"],
        }  # fmt: skip
        print(f"{name:10} {case:10} off {off['tokens_per_s']:8.1f} tok/s, ngram "
              f"{on['tokens_per_s']:8.1f} ({out[case]['speedup']:.2f}x), kept "
              f"{on['accepted_tokens']} of {on['draft_tokens']} drafts, equal "
              f"{out[case]['equal_outputs']}", flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=None, help="output tokens a request")
    parser.add_argument("--k", type=int, default=4, help="drafts a step")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    tokens = args.tokens or (128 if cuda else 12)
    count = 4 if cuda else 1
    big = "llama3-8b" if cuda else "tiny-llama"
    with Sections(args, script="speculative", k=args.k, tokens=tokens) as section:
        ceiling = section("ceilings", lambda: ceilings.measure(section.device)) or {}
        default = str(ensure_default_model())
        section("default", lambda: compare(
            section, "pydoc-llama", default, "auto",
            {"quoting": quoting_prompts(count)["code edit"]}, tokens, args.k, ceiling))  # fmt: skip

        def big_model() -> dict:
            folder, load_format = preset_folder(section.tmp, big)
            vocab = ModelConfig.from_pretrained(folder).vocab_size
            segment = random_prompts(1, 64, vocab, seed=5)[0]
            cases = {"random": random_prompts(count, 512, vocab, seed=3),
                     "repeating": [segment * 8] * count}  # fmt: skip
            return compare(section, big, folder, load_format, cases, tokens, args.k, ceiling)

        section(big, big_model)
        if cuda:
            torch.cuda.empty_cache()
        return section.results


if __name__ == "__main__":
    main()
