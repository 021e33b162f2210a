"""Triton neox-style rotary embedding, alone and fused with the paged KV-cache write.

One launch covers a step: grid (token, head block), where the head blocks
cover the q heads first and then the k heads; a k program also copies the
matching v heads, so the fused op rotates q and k and stores k and v at their
cache slots without a second pass over k. q/k/v may be strided views of the
fused qkv projection (unit last stride). Rounding follows `kernels.reference`
(cos/sin cast to the input dtype, each product and the sum rounded to it).

A negative slot (the padding convention for CUDA-graph batches) skips the
cache store for that token. Positions must lie inside cos_sin and slots inside
the cache: checking would need a host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.selection import Selector, next_power_of_2

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _rnd(v, dtype: tl.constexpr):
    return v.to(dtype).to(tl.float32)


@triton.jit
def _rotate(src_ptr, dst_ptr, heads, mask, d, cos, sin, HALF, stride_h):
    """Rotates [BLOCK_HEADS, D] (src rows at stride_h) into contiguous dst rows; returns halves."""
    src = src_ptr + heads[:, None] * stride_h + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    dtype: tl.constexpr = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = _rnd(_rnd(x1 * cos, dtype) - _rnd(x2 * sin, dtype), dtype)
    o2 = _rnd(_rnd(x2 * cos, dtype) + _rnd(x1 * sin, dtype), dtype)
    dst = dst_ptr + heads[:, None] * (2 * HALF) + d[None, :]
    tl.store(dst, o1.to(dtype), mask=mask)
    tl.store(dst + HALF, o2.to(dtype), mask=mask)
    return o1, o2


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, q_out_ptr, k_out_ptr, cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_cb, stride_ckv, stride_co, stride_ch,
    n_q_heads, n_kv_heads, block_size, HALF,
    WRITE_CACHE: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    n_q_blocks = tl.cdiv(n_q_heads, BLOCK_HEADS)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dtype: tl.constexpr = q_ptr.dtype.element_ty
    cos = _rnd(tl.load(cs_ptr + pos * stride_cs + d, mask=d_mask, other=0.0), dtype)
    sin = _rnd(tl.load(cs_ptr + pos * stride_cs + HALF + d, mask=d_mask, other=0.0), dtype)
    cos = cos[None, :]
    sin = sin[None, :]
    if head_block < n_q_blocks:
        heads = head_block * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
        mask = (heads < n_q_heads)[:, None] & d_mask[None, :]
        _rotate(
            q_ptr + t * stride_qt, q_out_ptr + t * n_q_heads * 2 * HALF,
            heads, mask, d, cos, sin, HALF, stride_qh,
        )  # fmt: skip
    else:
        heads = (head_block - n_q_blocks) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
        mask = (heads < n_kv_heads)[:, None] & d_mask[None, :]
        k1, k2 = _rotate(
            k_ptr + t * stride_kt, k_out_ptr + t * n_kv_heads * 2 * HALF,
            heads, mask, d, cos, sin, HALF, stride_kh,
        )  # fmt: skip
        if WRITE_CACHE:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            mask = mask & (slot >= 0)
            entry = (slot // block_size) * stride_cb + (slot % block_size) * stride_co
            dst = cache_ptr + entry + heads[:, None] * stride_ch + d[None, :]
            cache_dtype: tl.constexpr = cache_ptr.dtype.element_ty
            tl.store(dst, k1.to(cache_dtype), mask=mask)
            tl.store(dst + HALF, k2.to(cache_dtype), mask=mask)
            v_src = v_ptr + t * stride_vt + heads[:, None] * stride_vh + d[None, :]
            v1 = tl.load(v_src, mask=mask, other=0.0)
            v2 = tl.load(v_src + HALF, mask=mask, other=0.0)
            tl.store(dst + stride_ckv, v1.to(cache_dtype), mask=mask)
            tl.store(dst + stride_ckv + HALF, v2.to(cache_dtype), mask=mask)


def _launch(q, k, v, positions, cos_sin, cache, slot_mapping, *, block_heads: int, num_warps: int):
    tokens, n_q_heads, head_dim = q.shape
    n_kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    write = cache is not None
    if not write:  # the kernel never touches these when WRITE_CACHE is off
        v, cache, slot_mapping = k, k_out[None, None], positions
    block_heads = min(block_heads, next_power_of_2(max(n_q_heads, n_kv_heads)))
    n_blocks = triton.cdiv(n_q_heads, block_heads) + triton.cdiv(n_kv_heads, block_heads)
    half = head_dim // 2
    _rotary_kernel[(tokens, n_blocks)](
        q, k, v, positions, cos_sin, q_out, k_out, cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin.stride(0),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        n_q_heads, n_kv_heads, cache.shape[2], half,
        WRITE_CACHE=write, BLOCK_HEADS=block_heads, BLOCK_HALF=next_power_of_2(half),
        num_warps=num_warps,
    )  # fmt: skip
    return q_out, k_out


# block_heads x head_dim elements per program: about 1-2K for head_dim 128.
_CONFIGS = [
    {"block_heads": 8, "num_warps": 4},
    {"block_heads": 4, "num_warps": 2},
    {"block_heads": 16, "num_warps": 4},
    {"block_heads": 16, "num_warps": 8},
    {"block_heads": 32, "num_warps": 8},
    {"block_heads": 2, "num_warps": 1},
]


def _bucket(q, k, v, positions, cos_sin, cache, slot_mapping):
    return (
        min(next_power_of_2(q.shape[0]), 1 << 16), q.shape[1], k.shape[1], q.shape[2],
        str(q.dtype), None if cache is None else str(cache.dtype),
    )  # fmt: skip


SELECTOR = Selector("rotary", {"per_token": _launch}, {"per_token": _CONFIGS}, _bucket)


def _check_qk(q, k, positions, cos_sin) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [T, heads, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    tokens, _, head_dim = q.shape
    if k.shape[0] != tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if q.dtype not in FLOAT_DTYPES or k.dtype != q.dtype:
        raise ValueError(f"q and k must share a dtype in {FLOAT_DTYPES}, got {q.dtype}, {k.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"q and k need unit last stride, got {q.stride()}, {k.stride()}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim or cos_sin.dtype != torch.float32:
        raise ValueError(
            f"cos_sin must be float32 [max_pos, {head_dim}], got {cos_sin.dtype} "
            f"{tuple(cos_sin.shape)}"
        )
    if cos_sin.stride(1) != 1:
        raise ValueError(f"cos_sin needs unit last stride, got {cos_sin.stride()}")
    if positions.shape != (tokens,) or positions.dtype not in INDEX_DTYPES:
        raise ValueError(f"positions must be int32/int64 [{tokens}], got {positions.dtype} "
                         f"{tuple(positions.shape)}")  # fmt: skip
    for name, t in (("k", k), ("positions", positions), ("cos_sin", cos_sin)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotation of q [T, Hq, D] and k [T, Hk, D]; returns new contiguous tensors."""
    _check_qk(q, k, positions, cos_sin)
    return SELECTOR(q, k, None, positions, cos_sin, None, None)


def rotary_cache_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k and stores rotated k and v at their slots of
    cache [num_blocks, 2, block_size, Hk, D], in one launch; returns (q_rot, k_rot)."""
    _check_qk(q, k, positions, cos_sin)
    if v.shape != k.shape or v.dtype != k.dtype or v.stride(-1) != 1:
        raise ValueError(f"v must match k's shape and dtype with unit last stride, got "
                         f"{tuple(v.shape)} {v.dtype} strides {v.stride()}")  # fmt: skip
    n_kv_heads, head_dim = k.shape[1], k.shape[2]
    if cache.dim() != 5 or cache.shape[1] != 2 or tuple(cache.shape[3:]) != (n_kv_heads, head_dim):
        raise ValueError(f"cache must be [num_blocks, 2, block_size, {n_kv_heads}, {head_dim}], "
                         f"got {tuple(cache.shape)}")  # fmt: skip
    if cache.dtype not in FLOAT_DTYPES or cache.stride(-1) != 1:
        raise ValueError(f"cache must be float with unit last stride, got {cache.dtype} "
                         f"strides {cache.stride()}")  # fmt: skip
    if slot_mapping.shape != (q.shape[0],) or slot_mapping.dtype not in INDEX_DTYPES:
        raise ValueError(f"slot_mapping must be int32/int64 [{q.shape[0]}], got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")  # fmt: skip
    for name, t in (("v", v), ("cache", cache), ("slot_mapping", slot_mapping)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    return SELECTOR(q, k, v, positions, cos_sin, cache, slot_mapping)
