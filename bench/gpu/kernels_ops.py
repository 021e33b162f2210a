"""The Triton layer kernels for the kernels benchmark, bf16, against the ceilings
measured in the same run.

Memory-bound ops (add+RMSNorm, RMSNorm, SiLU-and-mul, RoPE+cache write) run at
16384 tokens x 4096-class widths and report GB/s counting every input read once
and every output written once (target: 80% of the copy bandwidth). Fused MoE
runs at Qwen3-30B-A3B shapes (E=128, top-8, hidden 2048, expert width 768,
renormalised): 64 tokens counts the bytes of the experts actually hit (target
60% of copy bandwidth), 4096 tokens counts T*k*(2*H*2I + 2*I*H) FLOPs (target
45% of the bf16 matmul rate); both should be at least SPEEDUP_TARGET x the torch
reference. Each kernel is checked against its reference on the benchmark inputs
first; max_rel_error is max|kernel - reference| / max|reference|. Times are
`timing.queued_ms`, as inside a CUDA graph.
"""

from __future__ import annotations

import dataclasses

import torch

from bench.gpu.timing import queued_ms
from kernels import reference
from kernels.activation import silu_and_mul
from kernels.fused_moe import fused_moe
from kernels.moe_routing import moe_route
from kernels.norm import fused_add_rms_norm, rms_norm
from kernels.rotary import SELECTOR as ROTARY_SELECTOR
from kernels.rotary import rotary_cache_write

DTYPE = torch.bfloat16
SPEEDUP_TARGET = 3.0


@dataclasses.dataclass(frozen=True)
class OpShapes:
    tokens: int = 16384  # 128 MiB per [T, H] bf16 tensor: well past the 60 MB L2
    hidden: int = 4096
    heads: tuple[int, int, int] = (32, 8, 128)  # Llama-3-8B attention: q, kv heads, dim
    positions: int = 131072
    moe: tuple[int, int, int, int] = (128, 8, 2048, 768)  # Qwen3-30B-A3B: E, top-k, H, I
    moe_tokens: tuple[int, int] = (64, 4096)  # a decode batch (bandwidth), a prefill (FLOPs)


GPU = OpShapes()
DRY = OpShapes(tokens=32, hidden=64, heads=(4, 2, 32), positions=256, moe=(8, 2, 64, 32),
               moe_tokens=(4, 40))  # fmt: skip


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


def bandwidth_row(op, shape, nbytes, kernel, ref, ceilings, err, device) -> dict:
    ms = queued_ms(kernel, device)
    ref_ms = queued_ms(ref, device, rounds=5)
    gbps = nbytes / (ms / 1e3) / 1e9
    return row(op, shape, ms, "GB/s", gbps, ceilings["copy_gbps"], 0.8, ref_ms, err)


def bench_norms(s: OpShapes, ceilings: dict, device: str) -> list[dict]:
    x = torch.randn(s.tokens, s.hidden, device=device, dtype=DTYPE)
    res = torch.randn(s.tokens, s.hidden, device=device, dtype=DTYPE)
    w = torch.rand(s.hidden, device=device, dtype=DTYPE) + 0.5
    eps, size = 1e-6, x.numel() * x.element_size()
    shape = f"{s.tokens}x{s.hidden} bf16"
    err = rel_error(
        fused_add_rms_norm(x, res, w, eps), reference.fused_add_rms_norm(x, res, w, eps)
    )
    rows = [bandwidth_row(
        "fused_add_rms_norm", shape, 4 * size + w.numel() * 2,
        lambda: fused_add_rms_norm(x, res, w, eps),
        lambda: reference.fused_add_rms_norm(x, res, w, eps), ceilings, err, device,
    )]  # fmt: skip
    err = rel_error(rms_norm(x, w, eps), reference.rms_norm(x, w, eps))
    rows.append(bandwidth_row(
        "rms_norm", shape, 2 * size + w.numel() * 2,
        lambda: rms_norm(x, w, eps), lambda: reference.rms_norm(x, w, eps), ceilings, err, device,
    ))  # fmt: skip
    return rows


def bench_silu(s: OpShapes, ceilings: dict, device: str) -> dict:
    gate_up = torch.randn(s.tokens, 2 * s.hidden, device=device, dtype=DTYPE) * 3
    err = rel_error(silu_and_mul(gate_up), reference.silu_and_mul(gate_up))
    nbytes = 3 * s.tokens * s.hidden * 2  # read gate and up, write the product
    return bandwidth_row(
        "silu_and_mul", f"{s.tokens}x{2 * s.hidden} -> {s.tokens}x{s.hidden} bf16", nbytes,
        lambda: silu_and_mul(gate_up), lambda: reference.silu_and_mul(gate_up), ceilings, err,
        device,
    )  # fmt: skip


def rotary_inputs(s: OpShapes, device: str) -> tuple:
    """rotary_cache_write's arguments: many sequences at scattered positions, their
    pages in random order across a pool twice the size they need."""
    (q_heads, kv_heads, head_dim), block_size, t = s.heads, 16, s.tokens
    qkv = torch.randn(t, (q_heads + 2 * kv_heads) * head_dim, device=device, dtype=DTYPE)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k, v = q.view(t, q_heads, head_dim), k.view(t, kv_heads, head_dim), v.view(t, kv_heads, -1)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device) / head_dim))
    freqs = torch.arange(s.positions, device=device, dtype=torch.float32)[:, None] * inv_freq
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    positions = torch.randint(0, s.positions, (t,), device=device)
    used = -(-t // block_size)
    pages = torch.randperm(2 * used, device=device)[:used]
    tokens = torch.arange(t, device=device)
    slots = pages[tokens // block_size] * block_size + tokens % block_size
    cache = torch.randn(2 * used, 2, block_size, kv_heads, head_dim, device=device, dtype=DTYPE)
    return q, k, v, positions, cos_sin, cache, slots


def bench_rotary(s: OpShapes, ceilings: dict, device: str) -> dict:
    q_heads, kv_heads, head_dim = s.heads
    q, k, v, positions, cos_sin, cache, slots = rotary_inputs(s, device)
    ref_cache = cache.clone()
    got = rotary_cache_write(q, k, v, positions, cos_sin, cache, slots)
    want = reference.rotary_cache_write(q, k, v, positions, cos_sin, ref_cache, slots)
    err = max(rel_error(got, want), rel_error(cache, ref_cache))
    t, elem = s.tokens, 2
    nbytes = (
        t * (q_heads + 2 * kv_heads) * head_dim * elem  # q, k, v
        + t * (8 + 8 + head_dim * 4)  # position, slot, cos/sin row
        + t * (q_heads + kv_heads) * head_dim * elem  # rotated q, k
        + t * 2 * kv_heads * head_dim * elem  # k, v cache entries
    )
    return bandwidth_row(
        "rotary_cache_write", f"T={t} q{q_heads} kv{kv_heads} d{head_dim} bf16", nbytes,
        lambda: rotary_cache_write(q, k, v, positions, cos_sin, cache, slots),
        lambda: reference.rotary_cache_write(q, k, v, positions, cos_sin, ref_cache, slots),
        ceilings, err, device,
    )  # fmt: skip


def rotary_configs(s: OpShapes, device: str) -> dict:
    """What the tuner measures for each launch config of the rotary bucket, and its choice."""
    args = rotary_inputs(s, device)
    report: dict = {}
    ROTARY_SELECTOR.tune(args, None, report)
    return {
        "configs": [{"config": c.kwargs, "tuner_ms": ms} for c, ms in report.items()],
        "selected": ROTARY_SELECTOR.choose(*args).kwargs,
    }


def bench_moe(s: OpShapes, ceilings: dict, device: str) -> list[dict]:
    experts, top_k, hidden, width = s.moe
    w13 = torch.randn(experts, 2 * width, hidden, device=device, dtype=DTYPE) * hidden**-0.5
    w2 = torch.randn(experts, hidden, width, device=device, dtype=DTYPE) * width**-0.5
    gate = torch.randn(experts, hidden, device=device, dtype=DTYPE) * hidden**-0.5
    decode_tokens, prefill_tokens = s.moe_tokens
    rows = []
    for tokens in (decode_tokens, prefill_tokens):
        x = torch.randn(tokens, hidden, device=device, dtype=DTYPE)
        weights, ids = moe_route(x @ gate.t(), top_k, True)
        args = (x, w13, w2, weights, ids)
        # The first call also tunes the launch config for this bucket.
        err = rel_error(fused_moe(*args), reference.fused_moe(*args))
        ms = queued_ms(lambda args=args: fused_moe(*args), device)
        ref_ms = queued_ms(lambda args=args: reference.fused_moe(*args), device, 0, 3)
        shape = f"T={tokens} E={experts} k={top_k} H={hidden} I={width} bf16"
        if tokens == decode_tokens:
            nbytes = torch.unique(ids).numel() * 3 * width * hidden * 2
            gbps = nbytes / (ms / 1e3) / 1e9
            rows.append(row("fused_moe_decode", shape, ms, "GB/s", gbps, ceilings["copy_gbps"],
                            0.6, ref_ms, err))  # fmt: skip
        else:
            flops = tokens * top_k * (2 * hidden * 2 * width + 2 * width * hidden)
            tflops = flops / (ms / 1e3) / 1e12
            rows.append(row("fused_moe_prefill", shape, ms, "TFLOP/s", tflops,
                            ceilings["matmul_bf16_tflops"], 0.45, ref_ms, err))  # fmt: skip
    return rows


def run(s: OpShapes, ceilings: dict, device: str) -> list[dict]:
    """Every layer kernel on `device`; one row per op."""
    torch.manual_seed(0)
    rows = bench_norms(s, ceilings, device)
    rows.append(bench_silu(s, ceilings, device))
    rows.append(bench_rotary(s, ceilings, device))
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows + bench_moe(s, ceilings, device)
