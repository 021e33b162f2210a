"""How often drafts are kept on the default model (pydoc-llama, trained on the
interpreter's documentation), per method, for prompts that quote their context:
a documentation topic followed by a request to summarize it ("summary"), and a
code example from the documentation followed by a request to repeat it edited
("code edit"). Greedy decoding on the CPU; each method's outputs are checked
equal to no speculation.

Per method and kind: drafts verified and kept, the kept share by position, and
tokens a sequence-step (1 + kept drafts per verifying step: what a step yields
when the verify pass costs what a one-token step costs, as on a GPU at small
batch, where the weights' read bounds a step).

Usage: python -m bench.speculative_acceptance [--prompts 24] [--max-tokens 96]
           [--k 4] [--out bench/results/speculative_acceptance_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from engine import LLM, SamplingParams
from yinian.default_corpus import topics
from yinian.default_model import ensure_default_model

METHODS = ("ngram", "trie")


def quoting_prompts(count: int) -> dict[str, list[str]]:
    """Summaries of documentation topics and edits of its code examples."""
    docs = sorted(topics().items())
    summaries, edits = [], []
    for name, text in docs:
        body = text.strip()[:1200]
        if len(summaries) < count and len(body) > 600:
            summaries.append(f"{body}\n\nIn short, {name} ")
        code = [block for block in text.split("\n\n") if _is_code(block)]
        if len(edits) < count and code:
            snippet = max(code, key=len)[:600]
            edits.append(f"Example:\n\n{snippet}\nThe same example, with each name spelled "
                         f"out:\n\n")  # fmt: skip
    return {"summary": summaries, "code edit": edits}


def _is_code(block: str) -> bool:
    """An indented example of 80 characters or more (not a grammar rule)."""
    lines = block.strip("\n").split("\n")
    return (len(block) >= 80 and "::=" not in block
            and all(line.startswith("   ") for line in lines))  # fmt: skip


def run(model: str, prompts: dict[str, list[str]], method: str | None, k: int, max_tokens: int):
    options = {"speculative_method": method, "num_speculative_tokens": k} if method else {}
    llm = LLM(model, device="cpu", dtype="float32", **options)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    rows = {}
    for kind, texts in prompts.items():
        before = llm.get_stats()
        start = time.perf_counter()
        outs = [o.outputs[0].token_ids for o in llm.generate(texts, params)]
        seconds = time.perf_counter() - start
        after = llm.get_stats()
        row = {"outputs": outs, "seconds": seconds, "tokens": sum(map(len, outs))}
        if method:
            steps = after["spec_draft_steps"] - before["spec_draft_steps"]
            drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
            kept = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            row |= {"verify_steps": steps, "draft_tokens": drafted, "accepted_tokens": kept,
                    "acceptance_rate": kept / drafted if drafted else 0.0,
                    "tokens_per_verify_step": 1 + kept / steps if steps else 1.0}  # fmt: skip
        rows[kind] = row
    if method:  # by position over the whole run (the engine counts since it started)
        rows["acceptance_by_position"] = llm.get_stats()["spec_acceptance_by_position"]
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=24, help="of each kind")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="drafts a step")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    model = str(ensure_default_model())
    prompts = quoting_prompts(args.prompts)
    base = run(model, prompts, None, args.k, args.max_tokens)
    result = {"model": Path(model).name, "k": args.k, "max_tokens": args.max_tokens,
              "prompts": {kind: len(v) for kind, v in prompts.items()}, "methods": {}}  # fmt: skip
    for method in METHODS:
        rows = run(model, prompts, method, args.k, args.max_tokens)
        for kind in prompts:
            rows[kind]["equal_to_off"] = rows[kind].pop("outputs") == base[kind]["outputs"]
        result["methods"][method] = rows
        for kind in prompts:
            r = rows[kind]
            print(f"{method:6} {kind:10} kept {r['accepted_tokens']:5} of {r['draft_tokens']:5} "
                  f"drafts ({r['acceptance_rate']:.2f}), {r['tokens_per_verify_step']:.2f} "
                  f"tokens a verifying step, equal to off: {r['equal_to_off']}")  # fmt: skip
        print(f"{method:6} kept by position: "
              + ", ".join(f"{x:.2f}" for x in rows["acceptance_by_position"]))  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
