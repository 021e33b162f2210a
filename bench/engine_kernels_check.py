"""On the GPU: the engine with Triton kernels and CUDA graphs against the same
engine on the torch references (same weights).

Checks, per model and dtype: prompt logits within 2e-2 relative error (eager
path), and greedy generations (decode through the graphs) equal token for
token except at near-ties, where the two candidates' logprobs under the
reference are within 1e-2 of each other (the comparison stops at such a tie).

In bfloat16 these random-weight models amplify one rounding step anywhere in
attention into logprob differences of several 1e-2, more than the near-tie
width, so the same comparison also runs between two torch references (one
with attention on float32 copies of its inputs) to show that spread; in
float32 both engines round far below it, and greedy tokens must match.
bench/engine_checks_gpu.py runs these checks for each model and dtype.
"""

from __future__ import annotations

import contextlib
import gc

import torch

from engine import LLM, SamplingParams
from engine.sequence import Sequence


def prompt_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    engine = llm.engine
    seq = Sequence("probe", "probe", 0, list(prompt), SamplingParams(), frozenset())
    assert engine.kv.allocate_slots(seq, len(prompt), [])
    inputs = engine.runner.prepare([seq], [len(prompt)], [engine.kv.block_ids(seq)])
    hidden = engine.runner.forward(inputs)
    from kernels import ops

    with ops.using(engine.runner.kernel_mode):
        logits = engine.runner.model.compute_logits(hidden)
    engine.kv.free(seq)
    return logits.float()


def release(llm: LLM) -> None:
    """Frees an engine's GPU memory now (its KV cache takes most of the device)."""
    llm.engine.runner.kv_caches.clear()
    llm.engine.runner.graphs = None
    llm.engine.runner.model = None
    gc.collect()
    torch.cuda.empty_cache()


def compare_greedy(ref_out, got_out) -> dict:
    """Tokens equal up to the end or up to a near-tie (|lp_a - lp_b| <= 1e-2 under ref)."""
    ref, got = ref_out.outputs[0], got_out.outputs[0]
    for j, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)):
        if a == b:
            continue
        entry = ref.logprobs[j]
        gap = abs(entry[a].logprob - entry[b].logprob) if b in entry else float("inf")
        return {"equal": False, "diverged_at": j, "logprob_gap": gap, "near_tie": gap <= 1e-2}
    return {
        "equal": len(ref.token_ids) == len(got.token_ids),
        "diverged_at": None,
        "logprob_gap": 0.0,
        "near_tie": False,
    }


def _settings(load_format: str, max_tokens: int, options: dict):
    """Engine options and greedy sampling shared by every engine a check compares."""
    # No start-up warm-up: these runs tune only the shapes they meet (speed is not measured).
    kw = dict(device="cuda", dtype="bfloat16", load_format=load_format, seed=0, warmup=False)
    kw.update(options)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=5)
    return kw, params


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


def _reference(kw: dict, folder, prompts, params, upcast: bool = False):
    """Prompt logits and greedy outputs of the engine on its torch references; with
    `upcast`, attention runs on float32 copies of its inputs."""
    ref = LLM(folder, kernels="torch", enforce_eager=True, **kw)
    try:
        with float32_attention() if upcast else contextlib.nullcontext():
            logits = [prompt_logits(ref, p) for p in prompts[:3]]
            outs = ref.generate(prompts, params)
    finally:
        release(ref)
    return logits, outs


def reference_spread(folder, load_format: str, prompts, max_tokens: int, **options) -> dict:
    """The same comparison between two torch references, the second with attention on
    float32 copies of its inputs: how far two valid references part on these weights."""
    kw, params = _settings(load_format, max_tokens, options)
    ref_logits, ref_outs = _reference(kw, folder, prompts, params)
    alt_logits, alt_outs = _reference(kw, folder, prompts, params, upcast=True)
    return _compare(ref_logits, ref_outs, alt_logits, alt_outs)


def _compare(ref_logits, ref_outs, got_logits, got_outs) -> dict:
    errors = [float((g - r).norm() / r.norm()) for g, r in zip(got_logits, ref_logits)]
    greedy = [compare_greedy(r, g) for r, g in zip(ref_outs, got_outs)]
    # Logprob of the same chosen token in both, up to the first divergence.
    lp_err = 0.0
    for a, b, g in zip(ref_outs, got_outs, greedy):
        upto = g["diverged_at"] if g["diverged_at"] is not None else len(a.outputs[0].token_ids)
        for j in range(upto):
            t = a.outputs[0].token_ids[j]
            lp_err = max(
                lp_err,
                abs(a.outputs[0].logprobs[j][t].logprob - b.outputs[0].logprobs[j][t].logprob),
            )
    return {
        "prompt_logits_rel_error": errors,
        "greedy": greedy,
        "max_logprob_diff_before_divergence": lp_err,
        "passed": all(g["equal"] or g["near_tie"] for g in greedy) and max(errors) < 2e-2,
    }


def check_model(
    folder, load_format: str, prompts: list[list[int]], max_tokens: int, **options
) -> dict:
    """The engine on its kernels and CUDA graphs against itself on the torch references."""
    kw, params = _settings(load_format, max_tokens, options)
    ref_logits, ref_outs = _reference(kw, folder, prompts, params)
    fast = LLM(folder, kernels="auto", **kw)
    try:
        assert fast.engine.runner.graphs is not None, "CUDA graphs were not captured"
        logits = [prompt_logits(fast, p) for p in prompts[:3]]
        outs = fast.generate(prompts, params)
    finally:
        release(fast)
    return _compare(ref_logits, ref_outs, logits, outs)
