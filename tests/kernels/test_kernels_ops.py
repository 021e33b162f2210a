"""The Triton layer kernels against their torch references, run on CPU through
Triton's interpreter (conftest.py selects it before the kernels are imported).

Shapes are small and deliberately awkward: odd row counts, hidden sizes that
are not powers of two, strided views of a fused qkv projection, GQA, positions
past 1024, cache slots scattered over non-adjacent blocks, and MoE routings
where some experts get no tokens. The interpreter rounds float32 -> bfloat16
by truncation (the GPU rounds to nearest), so bfloat16 gets a few ulps of slack.
On a CUDA machine the same tests run the compiled kernels on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import fused_moe as fused_moe_kernel
from kernels import moe_routing, reference
from kernels.activation import silu_and_mul
from kernels.fused_moe import fused_moe
from kernels.fused_moe_rows import ROWS_CONFIGS, fused_moe_rows
from kernels.moe_routing import moe_align, moe_route
from kernels.norm import fused_add_rms_norm, rms_norm
from kernels.rotary import apply_rotary, rotary_cache_write

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=3e-2, atol=3e-2),
}


@pytest.fixture(autouse=True)
def on_device():
    """Tensors the tests make land on DEVICE (random ones are drawn on CPU, then moved)."""
    torch.set_default_device(DEVICE)
    yield
    torch.set_default_device("cpu")


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=gen(seed), device="cpu") * scale).to(DEVICE, dtype)


def randint(low, high, shape, seed=0):
    return torch.randint(low, high, shape, generator=gen(seed), device="cpu").to(DEVICE)


def assert_close(actual, expected, dtype=None):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, **TOL[dtype or expected.dtype])


# ---- RMSNorm ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rows,hidden", [(1, 48), (3, 80), (17, 48), (17, 80)])
def test_rms_norm(rows, hidden, dtype):
    x = randn(rows, hidden, dtype=dtype, seed=rows)
    w = randn(hidden, dtype=dtype, seed=1)
    assert_close(rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    r = randn(rows, hidden, dtype=dtype, seed=2)
    normed, summed = fused_add_rms_norm(x, r, w, 1e-5)
    ref_normed, ref_summed = reference.fused_add_rms_norm(x, r, w, 1e-5)
    assert_close(summed, ref_summed)
    assert_close(normed, ref_normed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_per_head_view_of_qkv(dtype):
    tokens, heads, kv_heads, head_dim = 5, 4, 1, 80
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=3)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    w = randn(head_dim, dtype=dtype, seed=4)
    assert not q.is_contiguous()
    assert_close(rms_norm(q, w, 1e-6), reference.rms_norm(q, w, 1e-6))
    assert_close(rms_norm(k, w, 1e-6), reference.rms_norm(k, w, 1e-6))


def test_rms_norm_strided_rows_4d_and_mixed_weight_dtype():
    wide = randn(17, 128, seed=5)
    x, r = wide[:, :48], wide[:, 64:112]
    w = randn(48, seed=6)
    assert_close(rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    for got, want in zip(
        fused_add_rms_norm(x, r, w, 1e-6), reference.fused_add_rms_norm(x, r, w, 1e-6)
    ):
        assert_close(got, want)
    x4 = randn(2, 3, 5, 48, seed=7)
    assert_close(rms_norm(x4, w, 1e-6), reference.rms_norm(x4, w, 1e-6))
    # bfloat16 activations with a float32 weight promote to float32, as in the reference.
    xb = randn(3, 48, dtype=torch.bfloat16, seed=8)
    assert_close(rms_norm(xb, w, 1e-6), reference.rms_norm(xb, w, 1e-6), torch.bfloat16)


# ---- SiLU-and-mul -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rows,width", [(1, 24), (3, 40), (17, 80)])
def test_silu_and_mul(rows, width, dtype):
    gate_up = randn(rows, 2 * width, dtype=dtype, seed=rows, scale=3.0)
    assert_close(silu_and_mul(gate_up), reference.silu_and_mul(gate_up))


def test_silu_and_mul_strided_and_3d():
    wide = randn(5, 100, seed=9, scale=3.0)
    view = wide[:, :80]
    assert_close(silu_and_mul(view), reference.silu_and_mul(view))
    x3 = randn(2, 3, 48, seed=10)
    assert_close(silu_and_mul(x3), reference.silu_and_mul(x3))


# ---- Rotary + KV-cache write ----------------------------------------------------------


def cos_sin_table(max_pos: int, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def qkv_views(tokens, q_heads, kv_heads, head_dim, dtype, seed):
    qkv = randn(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    return (q.view(tokens, q_heads, head_dim), k.view(tokens, kv_heads, head_dim),
            v.view(tokens, kv_heads, head_dim))  # fmt: skip


ROTARY_CASES = [(1, 8, 1, 64), (3, 8, 4, 48), (17, 8, 8, 80), (17, 32, 4, 128)]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", ROTARY_CASES)
def test_rotary_cache_write(tokens, q_heads, kv_heads, head_dim, dtype):
    q, k, v = qkv_views(tokens, q_heads, kv_heads, head_dim, dtype, seed=tokens)
    cos_sin = cos_sin_table(4096, head_dim)
    positions = randint(1000, 4096, (tokens,), seed=1)
    positions[0] = 1024
    num_blocks, block_size = 13, 4
    # Scattered, non-adjacent blocks; consecutive tokens cross page boundaries.
    blocks = torch.tensor([11, 2, 7, 0, 5, 9])
    start = 2
    slots = torch.stack([blocks[(start + i) // block_size] * block_size + (start + i) % block_size
                         for i in range(tokens)])  # fmt: skip
    cache = randn(num_blocks, 2, block_size, kv_heads, head_dim, dtype=dtype, seed=2)
    ref_cache = cache.clone()
    q_rot, k_rot = rotary_cache_write(q, k, v, positions, cos_sin, cache, slots)
    ref_q, ref_k = reference.rotary_cache_write(q, k, v, positions, cos_sin, ref_cache, slots)
    assert_close(q_rot, ref_q)
    assert_close(k_rot, ref_k)
    assert_close(cache, ref_cache)
    q_only, k_only = apply_rotary(q, k, positions.to(torch.int32), cos_sin)
    assert_close(q_only, ref_q)
    assert_close(k_only, ref_k)


def test_rotary_cache_write_float32_cache_and_skipped_slots():
    q, k, v = qkv_views(5, 4, 2, 48, torch.bfloat16, seed=3)
    cos_sin = cos_sin_table(2048, 48)
    positions = torch.tensor([0, 1023, 1024, 1025, 2047])
    slots = torch.tensor([17, -1, 3, 40, -1])
    cache = torch.zeros(11, 2, 4, 2, 48)
    rotary_cache_write(q, k, v, positions, cos_sin, cache, slots)
    ref_cache = torch.zeros_like(cache)
    keep = slots >= 0
    ref_q, ref_k = reference.apply_rotary(q, k, positions, cos_sin)
    reference.write_kv_cache(ref_k[keep], v[keep], ref_cache, slots[keep])
    assert_close(cache, ref_cache, torch.bfloat16)


# ---- MoE routing, alignment, fused experts ----------------------------------------------


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 4, 1), (5, 8, 2), (33, 6, 2), (17, 60, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_route(tokens, experts, top_k, renormalize, dtype):
    logits = randn(tokens, experts, dtype=dtype, seed=tokens, scale=2.0)
    weights, ids = moe_route(logits, top_k, renormalize)
    ref_weights, ref_ids = reference.moe_route(logits, top_k, renormalize)
    assert ids.dtype == ref_ids.dtype
    assert_close(weights, ref_weights, torch.float32)
    if dtype == torch.float32:
        assert torch.equal(ids, ref_ids)
    else:  # bfloat16 logits tie; ties may be taken in either order
        probs = torch.softmax(logits.float(), dim=-1)
        assert torch.equal(probs.gather(1, ids), probs.gather(1, ref_ids))
        assert all(len(set(row)) == top_k for row in ids.tolist())


@pytest.mark.parametrize("one_program", [True, False], ids=["one program", "three kernels"])
@pytest.mark.parametrize(
    "tokens,top_k,experts,block_m", [(1, 2, 8, 16), (33, 2, 5, 4), (17, 8, 60, 16), (0, 2, 8, 16)]
)
def test_moe_align_groups_pairs_by_expert(tokens, top_k, experts, block_m, one_program,
                                          monkeypatch):  # fmt: skip
    # up to ONE_PROGRAM_PAIRS pairs one program aligns them, more take three kernels
    monkeypatch.setattr(moe_routing, "ONE_PROGRAM_PAIRS", 1 << 20 if one_program else -1)
    ids = randint(0, experts, (tokens, top_k), seed=tokens).to(torch.int32)
    if tokens:  # ids out of range are dropped
        ids[0, 0], ids[-1, -1] = -1, experts
    sorted_ids, expert_ids, total = moe_align(ids, experts, block_m)
    n = tokens * top_k
    kept = ids.flatten().long()
    counts = torch.bincount(kept[(kept >= 0) & (kept < experts)], minlength=experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert total.item() == padded.sum().item()
    start = 0
    for e in range(experts):
        run = sorted_ids[start : start + padded[e]]
        real = run[run < n].long()
        assert sorted(real.tolist()) == torch.nonzero(ids.flatten() == e).flatten().tolist()
        assert (run[counts[e] :] == n).all()
        assert (expert_ids[start // block_m : (start + padded[e]) // block_m] == e).all()
        start += padded[e].item()
    assert (expert_ids[start // block_m :] == -1).all()
    assert (sorted_ids[start:] == n).all()  # the unused tail is padding too


MOE_CASES = [
    # tokens, experts, top_k, hidden, width
    (1, 8, 2, 48, 40),
    (5, 4, 1, 32, 16),
    (5, 6, 2, 64, 48),
    (33, 8, 2, 48, 40),
    (33, 5, 1, 64, 24),
]


def moe_inputs(tokens, experts, top_k, hidden, width, dtype, seed=0):
    x = randn(tokens, hidden, dtype=dtype, seed=seed)
    w13 = randn(experts, 2 * width, hidden, dtype=dtype, seed=seed + 1, scale=hidden**-0.5)
    w2 = randn(experts, hidden, width, dtype=dtype, seed=seed + 2, scale=width**-0.5)
    logits = randn(tokens, experts, seed=seed + 3)
    return x, w13, w2, logits


# The interpreter's tl.dot multiplies bfloat16 tiles as raw integers, so bfloat16 is GPU-only.
MOE_DTYPES = FLOATS if DEVICE == "cuda" else [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", MOE_DTYPES)
@pytest.mark.parametrize("tokens,experts,top_k,hidden,width", MOE_CASES)
def test_fused_moe(tokens, experts, top_k, hidden, width, dtype):
    x, w13, w2, logits = moe_inputs(tokens, experts, top_k, hidden, width, dtype, seed=tokens)
    weights, ids = moe_route(logits, top_k, renormalize=True)
    got = fused_moe(x, w13, w2, weights, ids)
    want = reference.fused_moe(x, w13, w2, weights, ids)
    assert_close(got, want)
    assert_close(fused_moe(x, w13, w2, weights, ids.to(torch.int32)), want)


@pytest.mark.parametrize("dtype", MOE_DTYPES)
@pytest.mark.parametrize("tokens,experts,top_k,hidden,width", MOE_CASES[:3])
def test_fused_moe_rows_kernels_and_the_load_they_count(tokens, experts, top_k, hidden, width,
                                                        dtype):  # fmt: skip
    # The per-pair kernels a decode step of a few tokens may take, every config, against the
    # reference; both variants add each expert's pairs to the load counter as bincount does.
    x, w13, w2, logits = moe_inputs(tokens, experts, top_k, hidden, width, dtype, seed=tokens)
    weights, ids = moe_route(logits, top_k, renormalize=True)
    want = reference.fused_moe(x, w13, w2, weights, ids)
    counted = torch.bincount(ids.reshape(-1), minlength=experts)
    for config in ROWS_CONFIGS:
        load = torch.full((experts,), 5, dtype=torch.int64)
        assert_close(fused_moe_rows(x, w13, w2, weights, ids, load, **config), want)
        assert torch.equal(load, counted + 5)
    load = torch.zeros(experts, dtype=torch.int64)
    assert_close(fused_moe(x, w13, w2, weights, ids.to(torch.int32), load), want)
    assert torch.equal(load, counted)


@pytest.mark.parametrize("dtype", MOE_DTYPES)
@pytest.mark.parametrize("shared_width", [80, 24])  # two routed widths; not whole ones
def test_fused_moe_adds_a_shared_expert(shared_width, dtype):
    # A DeepSeek layer's shared experts, inside the per-pair kernels (a shared width that
    # is a multiple of the routed one; the tuner offers them no other) and beside the
    # grouped kernels; fused_moe adds them either way.
    x, w13, w2, logits = moe_inputs(3, 8, 3, 48, 40, dtype, seed=11)
    shared = (randn(2 * shared_width, 48, dtype=dtype, seed=12, scale=1 / 7),
              randn(48, shared_width, dtype=dtype, seed=13, scale=1 / 9))  # fmt: skip
    weights, ids = moe_route(logits, 3, renormalize=True)
    want = reference.fused_moe(x, w13, w2, weights, ids, None, shared)
    assert not torch.allclose(want, reference.fused_moe(x, w13, w2, weights, ids), atol=0.05)
    counted = torch.bincount(ids.reshape(-1), minlength=8)
    for config in ROWS_CONFIGS[:2]:
        load = torch.zeros(8, dtype=torch.int64)  # counted beside the shared expert's pairs
        if shared_width % 40:  # not whole routed widths: the per-pair kernels refuse it
            with pytest.raises(ValueError, match="multiple of the routed"):
                fused_moe_rows(x, w13, w2, weights, ids, load, shared, **config)
            assert not load.any()  # refused before anything was counted
            continue
        assert_close(fused_moe_rows(x, w13, w2, weights, ids, load, shared, **config), want)
        assert torch.equal(load, counted)
    load = torch.zeros(8, dtype=torch.int64)
    assert_close(fused_moe(x, w13, w2, weights, ids, load, shared), want)
    assert torch.equal(load, counted)
    # the tuner times the per-pair kernels only where they take the shared expert
    args = (x, w13, w2, weights, ids, None, shared)
    timed = {c.variant for c in fused_moe_kernel._selector.suiting(
        fused_moe_kernel._selector.candidates, args)}  # fmt: skip
    assert timed == ({"grouped", "rows"} if shared_width % 40 == 0 else {"grouped"})


def test_moe_align_counts_the_load_across_programs():
    # More pairs than one program aligns: the histogram kernel's programs each add theirs.
    ids = randint(0, 7, (700, 2), seed=3)
    load = torch.full((7,), 2, dtype=torch.int64)
    sorted_ids, _, _ = moe_align(ids, 7, 16, load)
    assert ids.numel() > moe_routing.ONE_PROGRAM_PAIRS
    assert torch.equal(load, torch.bincount(ids.reshape(-1), minlength=7) + 2)
    assert sorted(sorted_ids[sorted_ids < ids.numel()].tolist()) == list(range(ids.numel()))


def test_fused_moe_rows_ignore_ids_out_of_range():
    x, w13, w2, _ = moe_inputs(2, 4, 2, 32, 16, torch.float32, seed=3)
    ids = torch.tensor([[1, -1], [4, 2]])
    load = torch.zeros(4, dtype=torch.int64)
    got = fused_moe_rows(x, w13, w2, torch.ones(2, 2), ids, load, **ROWS_CONFIGS[0])
    kept = reference.fused_moe(x, w13, w2, torch.tensor([[1.0, 0.0], [0.0, 1.0]]),
                               torch.tensor([[1, 0], [0, 2]]))  # fmt: skip
    assert_close(got, kept)
    assert load.tolist() == [0, 1, 1, 0]


def test_fused_moe_unbalanced_routing():
    # Every token picks expert 2 first; expert 0 gets nothing.
    x, w13, w2, _ = moe_inputs(33, 4, 2, 32, 16, torch.float32, seed=5)
    ids = torch.stack([torch.full((33,), 2), torch.arange(33) % 3 + 1], dim=1)
    ids[:, 1] = torch.where(ids[:, 1] == 2, 3, ids[:, 1])
    weights = torch.softmax(randn(33, 2, seed=6), dim=-1)
    assert_close(fused_moe(x, w13, w2, weights, ids), reference.fused_moe(x, w13, w2, weights, ids))


# ---- Input checks -----------------------------------------------------------------------


def test_bad_inputs_raise_value_error():
    x = randn(3, 48)
    w = randn(48)
    bad = [
        lambda: rms_norm(x, randn(40), 1e-6),
        lambda: rms_norm(x.to(torch.int32), w, 1e-6),
        lambda: rms_norm(randn(48, 3).t(), w, 1e-6),
        lambda: fused_add_rms_norm(x, randn(3, 40), w, 1e-6),
        lambda: fused_add_rms_norm(x, x.half(), w, 1e-6),
        lambda: silu_and_mul(randn(3, 47)),
        lambda: silu_and_mul(randn(48, 3).t()),
        lambda: silu_and_mul(torch.ones(3, 4, dtype=torch.int64)),
    ]
    q, k, v = qkv_views(3, 4, 2, 48, torch.float32, seed=0)
    cos_sin, pos = cos_sin_table(64, 48), torch.arange(3)
    cache, slots = torch.zeros(4, 2, 4, 2, 48), torch.arange(3)
    bad += [
        lambda: apply_rotary(q, k, pos, cos_sin[:, :40]),
        lambda: apply_rotary(q, k, pos, cos_sin.double()),
        lambda: apply_rotary(q, k.half(), pos, cos_sin),
        lambda: apply_rotary(q, k, pos.float(), cos_sin),
        lambda: apply_rotary(q[..., :47], k[..., :47], pos, cos_sin[:, :47]),
        lambda: apply_rotary(q.transpose(0, 2), k, pos, cos_sin),
        lambda: rotary_cache_write(q, k, v, pos, cos_sin, torch.zeros(4, 2, 4, 3, 48), slots),
        lambda: rotary_cache_write(q, k, v, pos, cos_sin, cache, slots[:2]),
        lambda: rotary_cache_write(q, k, v[:, :1], pos, cos_sin, cache, slots),
    ]
    xm, w13, w2, logits = moe_inputs(5, 4, 2, 32, 16, torch.float32)
    weights, ids = reference.moe_route(logits, 2, True)
    bad += [
        lambda: moe_route(logits, 5, True),
        lambda: moe_route(logits, 0, True),
        lambda: moe_route(logits.long(), 2, True),
        lambda: moe_align(ids.float(), 4, 16),
        lambda: moe_align(ids, 4, 12),
        lambda: fused_moe(xm.half(), w13, w2, weights, ids),
        lambda: fused_moe(xm, w13[:, :30], w2, weights, ids),
        lambda: fused_moe(xm, w13, w2.transpose(1, 2), weights, ids),
        lambda: fused_moe(xm, w13, w2, weights, ids.float()),
        lambda: fused_moe(xm, w13, w2, weights[:, :1], ids),
        lambda: fused_moe(xm[:4], w13, w2, weights, ids),
        lambda: fused_moe(xm, w13, w2, weights, ids, torch.zeros(4, dtype=torch.int32)),
        lambda: fused_moe(xm, w13, w2, weights, ids, torch.zeros(3, dtype=torch.int64)),
        lambda: moe_align(ids, 4, 16, torch.zeros(5, dtype=torch.int64)),
        lambda: fused_moe(xm, w13, w2, weights, ids, None, (randn(30, 32), randn(32, 16))),
        lambda: fused_moe(xm, w13, w2, weights, ids, None, (randn(32, 32), randn(31, 16))),
        lambda: fused_moe(xm, w13, w2, weights, ids, None, (randn(32, 32).half(), randn(32, 16))),
    ]
    for i, call in enumerate(bad):
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"case {i} did not raise")


def test_empty_batch():
    assert rms_norm(torch.empty(0, 48), randn(48), 1e-6).shape == (0, 48)
    assert silu_and_mul(torch.empty(0, 48)).shape == (0, 24)
    x, w13, w2, _ = moe_inputs(1, 4, 2, 32, 16, torch.float32)
    out = fused_moe(x[:0], w13, w2, torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int64))
    assert out.shape == (0, 32) and not math.isnan(out.sum().item())


@pytest.mark.parametrize("tokens,experts,top_k,hidden,width", [MOE_CASES[2], MOE_CASES[3]])
def test_fused_moe_of_the_experts_held_sums_to_the_whole(tokens, experts, top_k, hidden, width):
    """Two expert services each hold half the experts and get every pair, the others'
    ids out of range: their outputs sum to the whole layer's (grouped and per-pair
    kernels and the reference), and each counts only its own pairs."""
    dtype = torch.float32
    x, w13, w2, logits = moe_inputs(tokens, experts, top_k, hidden, width, dtype, seed=7)
    weights, ids = moe_route(logits, top_k, renormalize=True)
    want = reference.fused_moe(x, w13, w2, weights, ids)
    half = experts // 2
    parts = []
    for held in (range(half), range(half, experts)):
        local = torch.full((experts,), -1, dtype=torch.int64)
        local[list(held)] = torch.arange(len(held))
        mine = local[ids]  # -1: a pair of the other service
        w13_h, w2_h = w13[list(held)].contiguous(), w2[list(held)].contiguous()
        load = torch.zeros(len(held), dtype=torch.int64)
        got = fused_moe(x, w13_h, w2_h, weights, mine.to(torch.int32), load)
        assert torch.equal(load, torch.bincount(mine[mine >= 0], minlength=len(held)))
        assert_close(fused_moe_rows(x, w13_h, w2_h, weights, mine, None, **ROWS_CONFIGS[0]), got)
        assert_close(reference.fused_moe(x, w13_h, w2_h, weights, mine), got)
        parts.append(got)
    assert_close(parts[0] + parts[1], want)
