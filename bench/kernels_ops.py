"""Benchmark of the Triton layer kernels on one GPU, bf16, against the ceilings
measured in the same run (`bench.ceilings`).

Memory-bound ops (add+RMSNorm, RMSNorm, SiLU-and-mul, RoPE+cache write) run at
16384 tokens x 4096-class widths and report GB/s counting every input read once
and every output written once (target: 80% of the copy bandwidth). Fused MoE
runs at Qwen3-30B-A3B shapes (E=128, top-8, hidden 2048, expert width 768,
renormalised): 64 tokens counts the bytes of the experts actually hit (target
60% of copy bandwidth), 4096 tokens counts T*k*(2*H*2I + 2*I*H) FLOPs (target
45% of the bf16 matmul rate); both should be at least SPEEDUP_TARGET x the torch
reference. Each kernel is checked against its reference on the benchmark inputs
first; max_rel_error is max|kernel - reference| / max|reference|.

Usage: python -m bench.kernels_ops --out DIR (or call run(ceilings) from a driver).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kernels import reference
from kernels.activation import silu_and_mul
from kernels.fused_moe import fused_moe
from kernels.moe_routing import moe_route
from kernels.norm import fused_add_rms_norm, rms_norm
from kernels.rotary import SELECTOR as ROTARY_SELECTOR
from kernels.rotary import rotary_cache_write
from kernels.selection import cuda_timer

DTYPE = torch.bfloat16
SPEEDUP_TARGET = 3.0
DEVICE = "cuda"
TOKENS, HIDDEN = 16384, 4096  # 128 MiB per [T, H] bf16 tensor: well past the 60 MB L2
MOE_EXPERTS, MOE_TOP_K, MOE_HIDDEN, MOE_WIDTH = 128, 8, 2048, 768  # Qwen3-30B-A3B
MOE_TOKENS = (64, 4096)  # a decode batch (weight-bandwidth bound), a prefill (FLOP bound)


def time_ms(fn, sample_ms: float = 3.0, rounds: int = 9) -> float:
    """GPU milliseconds of one call: the median over `rounds` samples, each about
    `sample_ms` of back-to-back calls queued while the GPU is held busy, so the host's
    launch cost (of the op's Python wrapper too) stays out, as inside a CUDA graph."""
    return cuda_timer(fn, warmup=1, reps=rounds, sample_ms=sample_ms)


def rel_error(got, want) -> float:
    if isinstance(got, tuple | list):
        return max(rel_error(g, w) for g, w in zip(got, want))
    diff = (got.float() - want.float()).abs().max().item()
    return diff / max(want.float().abs().max().item(), 1e-30)


def row(op, shape, ms, metric, achieved, ceiling, target, ref_ms, err) -> dict:
    return {
        "op": op, "shape": shape, "ms": ms, "metric": metric, "achieved": achieved,
        "fraction_of_ceiling": achieved / ceiling, "target": target,
        "speedup_vs_reference": ref_ms / ms, "max_rel_error": err,
    }  # fmt: skip


def bandwidth_row(op, shape, nbytes, kernel, ref, ceilings, err) -> dict:
    ms = time_ms(kernel)
    ref_ms = time_ms(ref, rounds=5)
    gbps = nbytes / (ms / 1e3) / 1e9
    return row(op, shape, ms, "GB/s", gbps, ceilings["copy_gbps"], 0.8, ref_ms, err)


def bench_norms(ceilings: dict) -> list[dict]:
    x = torch.randn(TOKENS, HIDDEN, device=DEVICE, dtype=DTYPE)
    res = torch.randn(TOKENS, HIDDEN, device=DEVICE, dtype=DTYPE)
    w = torch.rand(HIDDEN, device=DEVICE, dtype=DTYPE) + 0.5
    eps, size = 1e-6, x.numel() * x.element_size()
    shape = f"{TOKENS}x{HIDDEN} bf16"
    rows = []
    err = rel_error(
        fused_add_rms_norm(x, res, w, eps), reference.fused_add_rms_norm(x, res, w, eps)
    )
    rows.append(bandwidth_row(
        "fused_add_rms_norm", shape, 4 * size + w.numel() * 2,
        lambda: fused_add_rms_norm(x, res, w, eps),
        lambda: reference.fused_add_rms_norm(x, res, w, eps), ceilings, err,
    ))  # fmt: skip
    err = rel_error(rms_norm(x, w, eps), reference.rms_norm(x, w, eps))
    rows.append(bandwidth_row(
        "rms_norm", shape, 2 * size + w.numel() * 2,
        lambda: rms_norm(x, w, eps), lambda: reference.rms_norm(x, w, eps), ceilings, err,
    ))  # fmt: skip
    return rows


def bench_silu(ceilings: dict) -> dict:
    width = HIDDEN
    gate_up = torch.randn(TOKENS, 2 * width, device=DEVICE, dtype=DTYPE) * 3
    err = rel_error(silu_and_mul(gate_up), reference.silu_and_mul(gate_up))
    nbytes = 3 * TOKENS * width * 2  # read gate and up, write the product
    return bandwidth_row(
        "silu_and_mul", f"{TOKENS}x{2 * width} -> {TOKENS}x{width} bf16", nbytes,
        lambda: silu_and_mul(gate_up), lambda: reference.silu_and_mul(gate_up), ceilings, err,
    )  # fmt: skip


def bench_rotary(ceilings: dict) -> dict:
    q_heads, kv_heads, head_dim, block_size = 32, 8, 128, 16  # Llama-3-8B attention
    qkv = torch.randn(TOKENS, (q_heads + 2 * kv_heads) * head_dim, device=DEVICE, dtype=DTYPE)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q = q.view(TOKENS, q_heads, head_dim)
    k = k.view(TOKENS, kv_heads, head_dim)
    v = v.view(TOKENS, kv_heads, head_dim)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=DEVICE) / head_dim))
    freqs = torch.arange(131072, device=DEVICE, dtype=torch.float32)[:, None] * inv_freq
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    # Many sequences at scattered positions; pages in random order across a larger pool.
    positions = torch.randint(0, 131072, (TOKENS,), device=DEVICE)
    used = -(-TOKENS // block_size)
    num_blocks = 2 * used
    pages = torch.randperm(num_blocks, device=DEVICE)[:used]
    t = torch.arange(TOKENS, device=DEVICE)
    slots = pages[t // block_size] * block_size + t % block_size
    cache = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    ref_cache = cache.clone()
    got = rotary_cache_write(q, k, v, positions, cos_sin, cache, slots)
    want = reference.rotary_cache_write(q, k, v, positions, cos_sin, ref_cache, slots)
    err = max(rel_error(got, want), rel_error(cache, ref_cache))
    elem = 2
    nbytes = (
        TOKENS * (q_heads + 2 * kv_heads) * head_dim * elem  # q, k, v
        + TOKENS * (8 + 8 + head_dim * 4)  # position, slot, cos/sin row
        + TOKENS * (q_heads + kv_heads) * head_dim * elem  # rotated q, k
        + TOKENS * 2 * kv_heads * head_dim * elem  # k, v cache entries
    )
    result = bandwidth_row(
        "rotary_cache_write", f"T={TOKENS} q{q_heads} kv{kv_heads} d{head_dim} bf16", nbytes,
        lambda: rotary_cache_write(q, k, v, positions, cos_sin, cache, slots),
        lambda: reference.rotary_cache_write(q, k, v, positions, cos_sin, ref_cache, slots),
        ceilings, err,
    )  # fmt: skip
    # What the tuner measured for each launch config of this bucket, and what it chose.
    args = (q, k, v, positions, cos_sin, cache, slots)
    report: dict = {}
    ROTARY_SELECTOR.tune(args, None, report)
    result["configs"] = [{"config": c.kwargs, "tuner_ms": ms} for c, ms in report.items()]
    result["selected"] = ROTARY_SELECTOR.choose(*args).kwargs
    return result


def bench_moe(ceilings: dict) -> list[dict]:
    experts, top_k, hidden, width = MOE_EXPERTS, MOE_TOP_K, MOE_HIDDEN, MOE_WIDTH
    w13 = torch.randn(experts, 2 * width, hidden, device=DEVICE, dtype=DTYPE) * hidden**-0.5
    w2 = torch.randn(experts, hidden, width, device=DEVICE, dtype=DTYPE) * width**-0.5
    gate = torch.randn(experts, hidden, device=DEVICE, dtype=DTYPE) * hidden**-0.5
    rows = []
    for tokens in MOE_TOKENS:
        x = torch.randn(tokens, hidden, device=DEVICE, dtype=DTYPE)
        weights, ids = moe_route(x @ gate.t(), top_k, True)
        args = (x, w13, w2, weights, ids)
        # The first call also tunes the launch config for this bucket.
        err = rel_error(fused_moe(*args), reference.fused_moe(*args))
        ms = time_ms(lambda args=args: fused_moe(*args))
        ref_ms = time_ms(lambda args=args: reference.fused_moe(*args), sample_ms=0, rounds=3)
        shape = f"T={tokens} E={experts} k={top_k} H={hidden} I={width} bf16"
        if tokens <= 256:
            hit = torch.unique(ids).numel()
            nbytes = hit * 3 * width * hidden * 2
            gbps = nbytes / (ms / 1e3) / 1e9
            rows.append(row("fused_moe_decode", shape, ms, "GB/s", gbps, ceilings["copy_gbps"],
                            0.6, ref_ms, err))  # fmt: skip
        else:
            flops = tokens * top_k * (2 * hidden * 2 * width + 2 * width * hidden)
            tflops = flops / (ms / 1e3) / 1e12
            rows.append(row("fused_moe_prefill", shape, ms, "TFLOP/s", tflops,
                            ceilings["matmul_bf16_tflops"], 0.45, ref_ms, err))  # fmt: skip
    return rows


def run(ceilings: dict) -> list[dict]:
    """Benchmarks every kernel on the current CUDA device; returns one row per op."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench.kernels_ops needs a CUDA device")
    torch.manual_seed(0)
    rows = bench_norms(ceilings)
    rows.append(bench_silu(ceilings))
    rows.append(bench_rotary(ceilings))
    torch.cuda.empty_cache()
    rows += bench_moe(ceilings)
    return rows


def main() -> None:
    from bench.ceilings import measure

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    ceilings = measure()
    rows = run(ceilings)
    for r in rows:
        print(f"{r['op']:20s} {r['shape']:44s} {r['ms']:8.4f} ms {r['achieved']:9.1f} "
              f"{r['metric']:7s} {r['fraction_of_ceiling']:6.1%} (target {r['target']:.0%}) "
              f"x{r['speedup_vs_reference']:5.1f} err {r['max_rel_error']:.1e}")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels_ops.json").write_text(
        json.dumps({"ceilings": ceilings, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
