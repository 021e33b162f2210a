"""Prefill attention for the kernels benchmark: one causal prompt (8192 tokens on the
GPU) through `extend_attention`, reported as TFLOP/s against the bf16 matmul ceiling
(target 50%) and against torch SDPA's backends on contiguous, GQA-expanded tensors
(target 0.9x the fastest), first checked against the torch reference. Prefill and SDPA
are timed per call with the L2 cache flushed.

`run_variants` times every extend variant on its own (its configs tuned here, each
one's time or why it was dropped, then its best forced), checks each against the
reference and against the pointer kernel (the tuner's own check), and names the
variant the Selector chose. The tuner times candidates with CUDA events.
"""

from __future__ import annotations

import torch

from bench.gpu.kernels_attention import (
    AttentionShapes,
    max_rel_error,
    prefill_sdpa_times,
    random_cache,
)
from bench.gpu.timing import flushed_ms
from kernels.attention_reference import paged_attention
from kernels.extend_attention import SELECTOR as EXTEND_SELECTOR
from kernels.extend_attention import extend_attention


def prefill_inputs(shapes: AttentionShapes, tokens: int, gen: torch.Generator) -> tuple:
    """extend_attention's arguments for one causal prompt of `tokens` tokens."""
    device, dtype, bs = gen.device, shapes.dtype, shapes.block_size
    q = torch.randn(tokens, shapes.q_heads, shapes.head_dim, generator=gen, device=device,
                    dtype=dtype)  # fmt: skip
    kv_size = (tokens, shapes.kv_heads, shapes.head_dim)
    k = torch.randn(kv_size, generator=gen, device=device, dtype=dtype)
    v = torch.randn(kv_size, generator=gen, device=device, dtype=dtype)
    # The new keys and values are in the cache too (the reference reads them from there).
    pages = tokens // bs
    cache = random_cache(shapes, 2 * pages, gen)
    blocks = torch.randperm(2 * pages, generator=gen, device=device)[:pages]
    cache[blocks, 0] = k.view(pages, bs, shapes.kv_heads, shapes.head_dim)
    cache[blocks, 1] = v.view(pages, bs, shapes.kv_heads, shapes.head_dim)
    block_tables = blocks.view(1, pages).to(torch.int32)
    query_start_loc = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    return q, k, v, cache, block_tables, query_start_loc, seq_lens, tokens, shapes.scale, out


def prefill_reference(args: tuple) -> torch.Tensor:
    q, cache, block_tables, tokens, scale = args[0], args[3], args[4], args[7], args[8]
    return paged_attention(q, cache, block_tables, [tokens], [tokens], scale)


def prefill_tflops(shapes: AttentionShapes, tokens: int, ms: float) -> float:
    flops = 4 * tokens**2 * shapes.q_heads * shapes.head_dim / 2  # causal: half of QK^T, PV
    return flops / (ms / 1e3) / 1e12


def run_prefill(shapes: AttentionShapes, matmul_tflops: float, device: str) -> dict:
    gen = torch.Generator(device=device).manual_seed(1)
    tokens = shapes.prefill_tokens
    args = prefill_inputs(shapes, tokens, gen)

    def kernel():
        return extend_attention(*args[:9], out=args[9])

    kernel()  # tunes the launch config for this bucket on first use
    selected = EXTEND_SELECTOR.choose(*args)
    ref = prefill_reference(args)
    error = max_rel_error(kernel(), ref)
    ms = flushed_ms(kernel, device)
    ref_ms = flushed_ms(lambda: prefill_reference(args), device)
    sdpa_ms = prefill_sdpa_times(shapes, *args[:3])
    tflops = prefill_tflops(shapes, tokens, ms)
    fastest_sdpa = min(sdpa_ms.values()) if sdpa_ms else None
    return {
        "op": "extend_attention (causal prefill)",
        "shape": f"tokens={tokens} {shapes.describe()}",
        "ms": ms,
        "metric": "TFLOP/s",
        "achieved": tflops,
        "fraction_of_ceiling": tflops / matmul_tflops,
        "target": 0.5,
        "speedup_vs_reference": ref_ms / ms,
        "speedup_vs_sdpa": fastest_sdpa / ms if fastest_sdpa else None,
        "sdpa_ms": sdpa_ms,
        "speedup_vs_sdpa_target": 0.9,
        "max_rel_error": error,
        "selected": {"variant": selected.variant, "config": selected.kwargs},
    }


def _configs_json(report: dict) -> list:
    return [{"config": c.kwargs, "result": r} for c, r in report.items()]


def bench_variant(variant: str, args: tuple, ref: torch.Tensor, pointer_out) -> dict:
    """One extend variant forced: its configs tuned here, then its best timed like the
    selected kernel and checked."""
    candidates = [c for c in EXTEND_SELECTOR.usable(args[0].device) if c.variant == variant]
    if not candidates:
        return {"offered": False}
    report: dict = {}
    try:
        best, tune_ms = EXTEND_SELECTOR.tune(args, candidates, report)
    except RuntimeError as exc:
        return {"error": str(exc), "configs": _configs_json(report)}

    def kernel():
        return EXTEND_SELECTOR.variants[variant](*args, **best.kwargs)

    try:
        out = kernel().clone()
        ms = flushed_ms(kernel, args[0].device)
    except Exception as exc:  # report it, and let the other variants run
        return {"error": f"{type(exc).__name__}: {exc}", "config": best.kwargs}
    error = max_rel_error(out, ref)
    return {
        "config": best.kwargs,
        "ms": ms,
        "tune_ms": tune_ms,  # the tuner's median (no L2 flush)
        "max_rel_error": error,
        "matches_reference": error < 2e-2,
        "configs": _configs_json(report),
        # what the tuner's check says of this output
        "tuner_check_vs_pointer": EXTEND_SELECTOR.verify(pointer_out, out) or "ok",
    }


def run_variants(shapes: AttentionShapes, fastest_sdpa_ms: float | None, device: str) -> dict:
    gen = torch.Generator(device=device).manual_seed(1)
    args = prefill_inputs(shapes, shapes.prefill_tokens, gen)
    ref = prefill_reference(args)
    pointer = EXTEND_SELECTOR.variants["flash"](*args, **EXTEND_SELECTOR.candidates[0].kwargs)
    pointer = pointer.clone()
    variants = {}
    for variant in EXTEND_SELECTOR.variants:
        row = bench_variant(variant, args, ref, pointer)
        if row.get("ms"):
            row["tflops"] = prefill_tflops(shapes, shapes.prefill_tokens, row["ms"])
            if fastest_sdpa_ms:
                row["speedup_vs_sdpa"] = fastest_sdpa_ms / row["ms"]
        variants[variant] = row
        torch.cuda.empty_cache()
    return variants
