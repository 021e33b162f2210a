"""On the GPU: the engine with Triton kernels and CUDA graphs against the same engine
on the torch references (same weights), for the tiny presets and llama3-8b, in each
dtype asked for, after how far two torch references part in bfloat16.

Checks, per model and dtype: prompt logits within 2e-2 relative error (eager
path), and greedy generations (decode through the graphs) equal token for
token except at near-ties, where the two candidates' logprobs under the
reference are within 1e-2 of each other (the comparison stops at such a tie).

In bfloat16 these random-weight models amplify one rounding step anywhere in
attention into logprob differences of several 1e-2, more than the near-tie
width, so the same comparison also runs between two torch references (one
with attention on float32 copies of its inputs) to show that spread; in
float32 both engines round far below it, and greedy tokens must match.

Usage: python -m bench.gpu.engine_checks --out bench/results/engine_checks.json
           [--dtypes float32 bfloat16] [--models NAME ...] [--skip NAME ...]
Sections: "spread/<model>" and "<model>/<dtype>"; prints a summary last. The dry run
(`--device cpu`) runs the kernels under Triton's interpreter, without graphs.
"""

from __future__ import annotations

import contextlib

import torch

from bench.gpu.models import preset_folder
from bench.gpu.sections import Sections, script_parser
from engine import LLM, SamplingParams
from engine.make_model import TINY_PRESETS
from engine.sequence import Sequence

# (models, spread models, prompt lengths, new tokens); llama3-8b gets its own prompts.
GPU = ((*TINY_PRESETS, "llama3-8b"), ("tiny-qwen3", "tiny-moe", "llama3-8b"), (1, 17, 200, 700), 24)
DRY = (("tiny-llama",), ("tiny-llama",), (1, 9, 20), 4)
LLAMA_PROMPTS = (1, 33, 500, 2000)


def prompts_for(name: str, lengths, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(len(name) * 1000 + sum(map(ord, name)))
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def prompt_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """The logits of a prompt's last token, computed eagerly in one forward pass."""
    engine = llm.engine
    seq = Sequence("probe", "probe", 0, list(prompt), SamplingParams(), frozenset())
    assert engine.kv.allocate_slots(seq, len(prompt))
    inputs = engine.runner.prepare([seq], [len(prompt)], [engine.kv.block_ids(seq)])
    hidden = engine.runner.forward(inputs)
    from kernels import ops

    with ops.using(engine.runner.kernel_mode):
        logits = engine.runner.model.compute_logits(hidden)
    engine.kv.free(seq)
    return logits.float()


def compare_greedy(ref_out, got_out) -> dict:
    """Tokens equal up to the end or up to a near-tie (|lp_a - lp_b| <= 1e-2 under ref)."""
    ref, got = ref_out.outputs[0], got_out.outputs[0]
    for j, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)):
        if a == b:
            continue
        entry = ref.logprobs[j]
        gap = abs(entry[a].logprob - entry[b].logprob) if b in entry else float("inf")
        return {"equal": False, "diverged_at": j, "logprob_gap": gap, "near_tie": gap <= 1e-2}
    equal = len(ref.token_ids) == len(got.token_ids)
    return {"equal": equal, "diverged_at": None, "logprob_gap": 0.0, "near_tie": False}


@contextlib.contextmanager
def float32_attention():
    """The torch reference's attention on float32 copies of q and of the cache blocks it
    reads, its output rounded back: a second reference, as valid as the first."""
    from kernels import attention_reference

    plain = attention_reference.paged_attention

    def upcast(q, cache, block_tables, query_lens, seq_lens, scale):
        pages = -(-max(seq_lens) // cache.shape[2])
        table = block_tables[:, :pages]
        used = torch.unique(table)
        local = torch.searchsorted(used, table).to(block_tables.dtype)
        out = plain(q.float(), cache.index_select(0, used.long()).float(), local, query_lens,
                    seq_lens, scale)  # fmt: skip
        return out.to(q.dtype)

    attention_reference.paged_attention = upcast
    try:
        yield
    finally:
        attention_reference.paged_attention = plain


def _run(llm: LLM, prompts, params, upcast: bool = False) -> tuple[list, list]:
    """Prompt logits of the first three prompts and greedy outputs of all; closes `llm`."""
    try:
        with float32_attention() if upcast else contextlib.nullcontext():
            logits = [prompt_logits(llm, p) for p in prompts[:3]]
            outs = llm.generate(prompts, params)
    finally:
        llm.close()
    return logits, outs


def _compare(ref_logits, ref_outs, got_logits, got_outs) -> dict:
    errors = [float((g - r).norm() / r.norm()) for g, r in zip(got_logits, ref_logits)]
    greedy = [compare_greedy(r, g) for r, g in zip(ref_outs, got_outs)]
    lp_err = 0.0  # logprob of the same chosen token in both, up to the first divergence
    for a, b, g in zip(ref_outs, got_outs, greedy):
        upto = g["diverged_at"] if g["diverged_at"] is not None else len(a.outputs[0].token_ids)
        for j in range(upto):
            t = a.outputs[0].token_ids[j]
            lp_a, lp_b = a.outputs[0].logprobs[j][t].logprob, b.outputs[0].logprobs[j][t].logprob
            lp_err = max(lp_err, abs(lp_a - lp_b))
    return {
        "prompt_logits_rel_error": errors,
        "greedy": greedy,
        "max_logprob_diff_before_divergence": lp_err,
        "passed": all(g["equal"] or g["near_tie"] for g in greedy) and max(errors) < 2e-2,
    }


class Check:
    """One model's engines: the torch reference, and the engine on its kernels."""

    def __init__(self, section: Sections, name: str, lengths, max_tokens: int):
        folder, load_format = preset_folder(section.tmp, name)
        self.folder, self.device = folder, section.device
        # No start-up warm-up: these runs tune only the shapes they meet.
        self.options = dict(device=section.device, load_format=load_format, seed=0,
                            warmup=False, max_num_seqs=16)  # fmt: skip
        vocab = 500
        if name == "llama3-8b":
            lengths, vocab, self.options["max_model_len"] = LLAMA_PROMPTS, 120000, 8192
        self.prompts = prompts_for(name, lengths, vocab)
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                     logprobs=5)  # fmt: skip
        self._references: dict[tuple[str, bool], tuple] = {}

    def reference(self, dtype: str, upcast: bool = False):
        """The torch reference's prompt logits and greedy outputs, run once per dtype (and
        upcast) however many comparisons read them (the references are deterministic)."""
        if (dtype, upcast) not in self._references:
            llm = LLM(self.folder, dtype=dtype, kernels="torch", enforce_eager=True,
                      **self.options)  # fmt: skip
            self._references[dtype, upcast] = _run(llm, self.prompts, self.params, upcast)
        return self._references[dtype, upcast]

    def spread(self) -> dict:
        """Two torch references in bfloat16, the second with attention on float32 copies."""
        return _compare(*self.reference("bfloat16"), *self.reference("bfloat16", upcast=True))

    def kernels(self, dtype: str, against: str | None = None) -> dict:
        """The engine on its kernels (and CUDA graphs, on the GPU) against the reference;
        with `against` (a dtype), both also against the reference in that dtype, so the
        kernels' distance from it reads beside the reference's own."""
        ref = self.reference(dtype)
        cuda = self.device == "cuda"
        fast = LLM(self.folder, dtype=dtype, kernels="auto" if cuda else "triton", **self.options)
        graphs = fast.engine.runner.graphs is not None
        if cuda and not graphs:
            fast.close()
            raise RuntimeError("CUDA graphs were not captured")
        got = _run(fast, self.prompts, self.params)
        result = _compare(*ref, *got) | {"cuda_graphs": graphs}
        if against is not None:
            other = self.reference(against)
            result[f"against_{against}"] = {"kernels": _compare(*other, *got),
                                            "reference": _compare(*other, *ref)}  # fmt: skip
        return result


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--models", nargs="+", help="models to check (default: all)")
    args = parser.parse_args(argv)
    models, spread_models, lengths, max_tokens = GPU if args.device == "cuda" else DRY
    if args.device != "cuda":
        args.dtypes = ["float32"]
    models = args.models or models
    with Sections(args, script="engine_checks") as section:
        checks = {name: Check(section, name, lengths, max_tokens) for name in models}
        for name in [m for m in spread_models if m in checks]:
            section(f"spread/{name}", checks[name].spread)
        for name, check in checks.items():
            for dtype in args.dtypes:
                section(f"{name}/{dtype}", lambda c=check, d=dtype: c.kernels(d))
        print("\n".join(summary(section.results)))
        return section.results


def summary(results: dict) -> list[str]:
    lines = []
    for name, check in results.items():
        if not isinstance(check, dict) or "greedy" not in check:
            continue
        parts = [
            "equal" if g["equal"] else f"parts at {g['diverged_at']} (gap {g['logprob_gap']:.4f})"
            for g in check["greedy"]
        ]
        lines.append(
            f"{name}: passed={check['passed']} logits rel err "
            f"{max(check['prompt_logits_rel_error']):.2e}, logprob diff "
            f"{check['max_logprob_diff_before_divergence']:.3f}; greedy: {', '.join(parts)}"
        )
    return lines


if __name__ == "__main__":
    main()
