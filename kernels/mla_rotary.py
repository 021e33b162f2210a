"""Triton MLA rotary + latent cache write: one launch per layer and step.

Grid (token, head block): the head-block programs rotate the query's rotary
part (read in place from the query projection, written to a new contiguous
tensor: the op must be idempotent, since the tuner runs it many times); one
more program per token rotates the shared k_pe and stores [latent | k_pe] at
the token's cache slot. With DeepSeek's interleaved layout, pairs (x0, x1),
(x2, x3) ... are read with a stride of two and written as neox halves, for
queries and keys alike, so no de-interleaving copy is made (q . k is the same
either way).

Rounding follows `kernels.reference.apply_rotary` (cos/sin cast to the input
dtype, each product and sum rounded to it). A negative slot skips the store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.norm import _normalize
from kernels.rotary import FLOAT_DTYPES, INDEX_DTYPES
from kernels.selection import Selector, next_power_of_2


@triton.jit
def _rnd(v, dtype: tl.constexpr):
    return v.to(dtype).to(tl.float32)


@triton.jit
def _rotate_rows(ptr, rows_offs, mask, d, cos, sin, HALF, INTERLEAVED: tl.constexpr):
    """Loads [rows, 2 * HALF] at ptr + rows_offs, returns the rotated halves (float32)."""
    if INTERLEAVED:
        first, second = 2 * d, 2 * d + 1
    else:
        first, second = d, d + HALF
    x1 = tl.load(ptr + rows_offs[:, None] + first[None, :], mask=mask, other=0.0)
    dtype: tl.constexpr = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = tl.load(ptr + rows_offs[:, None] + second[None, :], mask=mask, other=0.0).to(tl.float32)
    o1 = _rnd(_rnd(x1 * cos, dtype) - _rnd(x2 * sin, dtype), dtype)
    o2 = _rnd(_rnd(x2 * cos, dtype) + _rnd(x1 * sin, dtype), dtype)
    return o1, o2


@triton.jit
def _mla_rotary_kernel(
    q_ptr, k_ptr, latent_ptr, pos_ptr, cs_ptr, q_out_ptr, k_out_ptr, cache_ptr, slot_ptr,
    norm_w_ptr, stride_qt, stride_qh, stride_kt, stride_lt, stride_cs,
    n_heads, HALF, LATENT, eps,
    ENTRY: tl.constexpr, PAGE_SIZE: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_C: tl.constexpr,
    NORM: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dtype: tl.constexpr = q_ptr.dtype.element_ty
    cos = _rnd(tl.load(cs_ptr + pos * stride_cs + d, mask=d_ok, other=0.0), dtype)
    sin = _rnd(tl.load(cs_ptr + pos * stride_cs + HALF + d, mask=d_ok, other=0.0), dtype)
    cos = cos[None, :]
    sin = sin[None, :]
    if head_block < tl.cdiv(n_heads, BLOCK_HEADS):
        heads = head_block * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
        mask = (heads < n_heads)[:, None] & d_ok[None, :]
        rows = heads * stride_qh
        base = q_ptr + t * stride_qt
        o1, o2 = _rotate_rows(base, rows, mask, d, cos, sin, HALF, INTERLEAVED)
        dst = q_out_ptr + t * n_heads * 2 * HALF + heads[:, None] * (2 * HALF) + d[None, :]
        tl.store(dst, o1.to(dtype), mask=mask)
        tl.store(dst + HALF, o2.to(dtype), mask=mask)
    else:
        # (Names unlike the other branch's: Triton merges same-named values of both.)
        one = tl.arange(0, 1)
        k_mask = d_ok[None, :]
        k1, k2 = _rotate_rows(k_ptr + t * stride_kt, one, k_mask, d, cos, sin, HALF, INTERLEAVED)
        k_out = k_out_ptr + t * 2 * HALF + one[:, None] + d[None, :]
        tl.store(k_out, k1.to(dtype), mask=k_mask)
        tl.store(k_out + HALF, k2.to(dtype), mask=k_mask)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            STRIDE_BLOCK: tl.constexpr = PAGE_SIZE * ENTRY
            entry = cache_ptr + (slot // PAGE_SIZE) * STRIDE_BLOCK + (slot % PAGE_SIZE) * ENTRY
            cache_dtype: tl.constexpr = cache_ptr.dtype.element_ty
            c = tl.arange(0, BLOCK_C)
            latent = tl.load(latent_ptr + t * stride_lt + c, mask=c < LATENT, other=0.0)
            if NORM:  # the latent's RMSNorm, as kernels.norm computes it
                row = latent.to(tl.float32)[None, :]
                normed = _normalize(row, norm_w_ptr, c, c < LATENT, LATENT, eps, dtype)
                latent = tl.sum(normed, axis=0).to(dtype)  # the one row
            tl.store(entry + c, latent.to(cache_dtype), mask=c < LATENT)
            k_dst = entry + LATENT + one[:, None] + d[None, :]
            tl.store(k_dst, k1.to(cache_dtype), mask=k_mask)
            tl.store(k_dst + HALF, k2.to(cache_dtype), mask=k_mask)


def _launch(q_pe, k_pe, latent, positions, cos_sin, cache, slot_mapping, interleaved,
            norm_weight=None, eps=0.0, *, block_heads: int, num_warps: int):  # fmt: skip
    tokens, n_heads, rope_dim = q_pe.shape
    q_out = torch.empty(tokens, n_heads, rope_dim, dtype=q_pe.dtype, device=q_pe.device)
    k_out = torch.empty(tokens, 1, rope_dim, dtype=k_pe.dtype, device=k_pe.device)
    if tokens == 0:
        return q_out, k_out
    block_heads = min(block_heads, next_power_of_2(n_heads))
    half = rope_dim // 2
    _mla_rotary_kernel[(tokens, triton.cdiv(n_heads, block_heads) + 1)](
        q_pe, k_pe, latent, positions, cos_sin, q_out, k_out, cache, slot_mapping,
        latent if norm_weight is None else norm_weight,
        q_pe.stride(0), q_pe.stride(1), k_pe.stride(0), latent.stride(0), cos_sin.stride(0),
        n_heads, half, latent.shape[1], float(eps),
        ENTRY=cache.shape[-1], PAGE_SIZE=cache.shape[2], INTERLEAVED=bool(interleaved),
        BLOCK_HEADS=block_heads, BLOCK_HALF=next_power_of_2(half),
        BLOCK_C=next_power_of_2(latent.shape[1]), NORM=norm_weight is not None,
        num_warps=num_warps,
    )  # fmt: skip
    return q_out, k_out


_CONFIGS = [
    {"block_heads": 16, "num_warps": 4},
    {"block_heads": 4, "num_warps": 1},
    {"block_heads": 32, "num_warps": 4},
    {"block_heads": 64, "num_warps": 8},
]


def _bucket(q_pe, k_pe, latent, positions, cos_sin, cache, slot_mapping, interleaved,
            norm_weight=None, eps=0.0):  # fmt: skip
    return (
        min(next_power_of_2(q_pe.shape[0]), 1 << 16), q_pe.shape[1], q_pe.shape[2],
        latent.shape[1], str(q_pe.dtype), str(cache.dtype), bool(interleaved),
    ) + (() if norm_weight is None else ("norm",))  # fmt: skip


SELECTOR = Selector("mla_rotary", {"per_token": _launch}, {"per_token": _CONFIGS}, _bucket)


def mla_rotary_cache_write(
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    latent: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    interleaved: bool,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q_pe [T, H, R] and k_pe [T, 1, R] (any strides, unit last stride), stores
    [latent [T, C] | rotated k_pe] at each slot of cache [num_blocks, 1, block_size, 1,
    C + R]; returns the rotated (q_pe, k_pe), contiguous (see
    kernels.mla_reference.mla_rotary_cache_write). With norm_weight [C], the latent is
    stored RMS-normalised (eps), as kernels.norm.rms_norm would make it."""
    if q_pe.dim() != 3 or k_pe.dim() != 3 or k_pe.shape[1] != 1 or latent.dim() != 2:
        shapes = f"{tuple(q_pe.shape)}, {tuple(k_pe.shape)}, {tuple(latent.shape)}"
        raise ValueError(f"expected q_pe [T, H, R], k_pe [T, 1, R], latent [T, C]; got {shapes}")
    tokens, _, rope_dim = q_pe.shape
    if k_pe.shape[0] != tokens or k_pe.shape[2] != rope_dim or latent.shape[0] != tokens:
        raise ValueError(f"k_pe {tuple(k_pe.shape)} / latent {tuple(latent.shape)} do not match "
                         f"q_pe {tuple(q_pe.shape)}")  # fmt: skip
    if rope_dim % 2:
        raise ValueError(f"the rotary dim must be even, got {rope_dim}")
    if q_pe.dtype not in FLOAT_DTYPES or k_pe.dtype != q_pe.dtype or latent.dtype != q_pe.dtype:
        raise ValueError(f"q_pe, k_pe, latent must share a dtype in {FLOAT_DTYPES}, got "
                         f"{q_pe.dtype}, {k_pe.dtype}, {latent.dtype}")  # fmt: skip
    if q_pe.stride(-1) != 1 or k_pe.stride(-1) != 1 or latent.stride(-1) != 1:
        raise ValueError("q_pe, k_pe and latent need unit last stride")
    width = latent.shape[1] + rope_dim
    if cache.dim() != 5 or tuple(cache.shape[3:]) != (1, width) or cache.shape[1] != 1:
        raise ValueError(f"cache must be [num_blocks, 1, block_size, 1, {width}], got "
                         f"{tuple(cache.shape)}")  # fmt: skip
    if cache.dtype not in FLOAT_DTYPES or not cache.is_contiguous():
        raise ValueError(f"cache must be a contiguous float tensor, got {cache.dtype}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != rope_dim or cos_sin.dtype != torch.float32:
        raise ValueError(f"cos_sin must be float32 [max_pos, {rope_dim}], got {cos_sin.dtype} "
                         f"{tuple(cos_sin.shape)}")  # fmt: skip
    for name, x in (("positions", positions), ("slot_mapping", slot_mapping)):
        if x.shape != (tokens,) or x.dtype not in INDEX_DTYPES:
            raise ValueError(f"{name} must be int32/int64 [{tokens}], got {x.dtype} "
                             f"{tuple(x.shape)}")  # fmt: skip
    if norm_weight is not None and (norm_weight.shape != (latent.shape[1],)
                                    or norm_weight.stride(0) != 1):  # fmt: skip
        raise ValueError(f"norm_weight must be [{latent.shape[1]}] with unit stride, got "
                         f"{tuple(norm_weight.shape)}")  # fmt: skip
    others = dict(k_pe=k_pe, latent=latent, positions=positions, cos_sin=cos_sin, cache=cache,
                  slot_mapping=slot_mapping, norm_weight=norm_weight)  # fmt: skip
    for name, x in others.items():
        if x is not None and x.device != q_pe.device:
            raise ValueError(f"{name} is on {x.device}, q_pe on {q_pe.device}")
    return SELECTOR(q_pe, k_pe, latent, positions, cos_sin, cache, slot_mapping,
                    bool(interleaved), norm_weight, float(eps))  # fmt: skip
