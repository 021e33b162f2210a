"""The default model (pydoc-llama, trained) in bf16 against float32, greedy, in the
engine and in Hugging Face transformers on the same device: the section
`default_dtypes` of bench/gpu/structured.py.

For each prompt: whether the engine's bf16 answer equals its float32 one, and
where it parts, the gap there between the two tokens' float32 logprobs (a
near-tie by bench/gpu/engine_checks.py's rule when within 1e-2). Beside it, the
reference: transformers' own bf16 and float32 answers to the same token ids, and
where they part. A prompt on which transformers' bf16 answer parts from its
float32 one too is one whose greedy path bf16 rounding decides, whichever
implementation rounds: the rule by which a part that is no near-tie is explained
(`explained_by_reference`). The two bf16 implementations round in different
places (attention, the order of sums), so they need not part at the same token.

How far bf16 moves a choice is measured in the same run (`rounding`): at every
position both answers share, the gap between float32's two likeliest tokens
(their logprob difference) is read in both runs; the difference is what bf16's
rounding did to that gap. A parting whose float32 gap is within the 99th
percentile of those moves (`within_rounding`) is one bf16 rounding reaches at
an ordinary position: a near-tie at bf16's own resolution, where the fixed 1e-2
rule is float32's.

Alone (the same section with more prompts, on either device):
    python -m bench.gpu.default_dtypes --out bench/results/default_dtypes_cpu.json
           --device cpu --prompts 96 --tokens 64
(default: 16 prompts of 64 tokens on CUDA; the dry run, 2 of 8)
"""

from __future__ import annotations

from bench.gpu.engine_checks import compare_greedy
from bench.gpu.sections import Sections, script_parser
from bench.gpu.speculative import first_difference
from bench.loadgen.metrics import nearest_rank
from engine import LLM, SamplingParams
from yinian.default_model import ensure_default_model

TOPICS = ["assert", "lambda", "for loops", "the import statement", "decorators", "generators",
          "list comprehensions", "exceptions"]  # fmt: skip

DTYPES = ("float32", "bfloat16")


def transformers_greedy(folder: str, prompts: list[list[int]], dtype: str, device: str,
                        tokens: int) -> list[list[int]]:  # fmt: skip
    """transformers' greedy answers (token ids, up to and with an end token), one prompt
    at a time (no padding)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    eos = model.config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos
    answers = []
    try:
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            with torch.no_grad():
                out = model.generate(x, max_new_tokens=tokens, do_sample=False, pad_token_id=pad)
            answers.append(out[0, len(ids) :].tolist())
    finally:
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    return answers


def parts_at(a: list[int], b: list[int]) -> int | None:
    """The first token where two answers differ; None when they are the same (equal as
    far as both go, one side at most one end token longer)."""
    at = first_difference(a, b)
    if at == min(len(a), len(b)) and abs(len(a) - len(b)) <= 1:
        return None  # one ends a token later: its end token
    return at


def same_answer(a: list[int], b: list[int]) -> bool:
    return parts_at(a, b) is None


def gap_moves(ref_out, got_out, upto: int | None) -> list[float]:
    """At each position both answers share (before `upto`), how far the second answer's
    logprobs move the gap between the first's two likeliest tokens."""
    ref, got = ref_out.outputs[0], got_out.outputs[0]
    moves = []
    for j, (a, b) in enumerate(zip(ref.logprobs, got.logprobs)):
        if upto is not None and j >= upto:
            break
        first, second = sorted(a, key=lambda t: a[t].logprob, reverse=True)[:2]
        if first in b and second in b:
            ref_gap = a[first].logprob - a[second].logprob
            moves.append(abs(ref_gap - (b[first].logprob - b[second].logprob)))
    return moves


def default_dtypes(folder: str, prompts: list[str], tokens: int, device: str) -> dict:
    params = SamplingParams(max_tokens=tokens, temperature=0, logprobs=5)
    outs = {}
    for dtype in DTYPES:
        # no start-up warm-up: it compiles every prefill shape for each dtype, where these
        # prompts need a few (stop 68's section took 354 s on an H100, most of it compiling)
        llm = LLM(folder, dtype=dtype, device=device, gpu_memory_utilization=0.3, warmup=False)
        try:
            outs[dtype] = llm.generate(prompts, params)
        finally:
            llm.close()
    ids = [o.prompt_token_ids for o in outs["float32"]]  # the ids the engine ran
    ref = {dtype: transformers_greedy(folder, ids, dtype, device, tokens) for dtype in DTYPES}
    # float32 is the reference: a divergence's gap is read from its logprobs
    pairs = list(zip(outs["float32"], outs["bfloat16"]))
    rows = [compare_greedy(a, b) for a, b in pairs]
    moves = [m for (a, b), row in zip(pairs, rows) for m in gap_moves(a, b, row["diverged_at"])]
    some = moves or [0.0]  # (no shared position: nothing moved)
    rounding = {"positions": len(moves), "p50": nearest_rank(some, 0.5),
                "p99": nearest_rank(some, 0.99), "max": max(some)}  # fmt: skip
    print(f"  bf16 moves float32's top-two gap by {rounding['p50']:.4f} (p50), "
          f"{rounding['p99']:.4f} (p99), {rounding['max']:.4f} (max) over "
          f"{rounding['positions']} shared positions")  # fmt: skip
    for i, row in enumerate(rows):
        engine_bf16 = outs["bfloat16"][i].outputs[0].token_ids
        row["transformers_parts_at"] = parts_at(ref["float32"][i], ref["bfloat16"][i])
        reference_equal = row["transformers_parts_at"] is None
        row["transformers_bf16_equals_float32"] = reference_equal
        row["equals_transformers_bf16"] = same_answer(engine_bf16, ref["bfloat16"][i])
        row["explained_by_reference"] = not (row["equal"] or reference_equal)
        row["within_rounding"] = not row["equal"] and row["logprob_gap"] <= rounding["p99"]
        if not row["equal"]:
            why = "a near-tie" if row["near_tie"] else "not a near-tie"
            why += (", within" if row["within_rounding"] else ", past") + " bf16's p99 move"
            if row["explained_by_reference"]:
                why += f"; transformers' bf16 parts too, at token {row['transformers_parts_at']}"
            print(f"  prompt {i}: parts at token {row['diverged_at']}, float32 logprob gap "
                  f"{row['logprob_gap']:.4f} ({why})")  # fmt: skip
    n = len(rows)
    counted = {
        "equal": "equal",
        "near_ties": "near_tie",
        "explained_by_reference": "explained_by_reference",
        "within_rounding": "within_rounding",
        "transformers_bf16_equals_float32": "transformers_bf16_equals_float32",
        "engine_bf16_equals_transformers": "equals_transformers_bf16",
    }
    result = {"prompts": n, **{k: sum(r[f] for r in rows) for k, f in counted.items()}}
    result["engine_float32_equals_transformers"] = sum(
        same_answer(o.outputs[0].token_ids, r) for o, r in zip(outs["float32"], ref["float32"])
    )
    result["rounding"] = rounding
    result["rows"] = rows
    print(f"default model: bf16 equals float32 on {result['equal']} of {n} prompts "
          f"(transformers: {result['transformers_bf16_equals_float32']} of {n}); the engine "
          f"equals transformers on {result['engine_float32_equals_transformers']} (float32) and "
          f"{result['engine_bf16_equals_transformers']} (bf16) of {n}", flush=True)  # fmt: skip
    return result


def prompts(count: int) -> list[str]:
    return [f"Explain {TOPICS[i % 8]} in Python, example {i}." for i in range(count)]


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--prompts", type=int)
    parser.add_argument("--tokens", type=int)
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    args.prompts = args.prompts or (16 if cuda else 2)
    args.tokens = args.tokens or (64 if cuda else 8)
    with Sections(args, script="default_dtypes", prompts=args.prompts) as section:
        folder, asked = str(ensure_default_model()), prompts(args.prompts)
        section("default_dtypes",
                lambda: default_dtypes(folder, asked, args.tokens, section.device))  # fmt: skip
        return section.results


if __name__ == "__main__":
    main()
