"""Triton RMSNorm and fused residual-add + RMSNorm.

Both hold whole rows in registers so each input is read once and each output
written once. Rows may come from a strided view (per-head q/k norm reads the
fused qkv projection in place), so the row address is outer * stride_outer +
inner * stride_inner over a [outer, inner, H] view of the input. Rounding
follows `kernels.reference`: statistics in float32, the normalised value cast
back to the input dtype before the weight multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.selection import Selector, next_power_of_2

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Holding a row in registers stops paying (spills) past this many columns.
MAX_HIDDEN = 32768


@triton.jit
def _row_offsets(rows, n_inner, stride_outer, stride_inner):
    rows = rows.to(tl.int64)
    return (rows // n_inner) * stride_outer + (rows % n_inner) * stride_inner


@triton.jit
def _normalize(s, w_ptr, cols, col_mask, H, eps, x_dtype: tl.constexpr):
    # s: float32 [BLOCK_ROWS, BLOCK_H] already rounded to the input dtype.
    var = tl.sum(s * s, axis=1) / H
    normed = (s * tl.rsqrt(var + eps)[:, None]).to(x_dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    return normed * w[None, :]


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr,
    n_rows, n_inner, stride_outer, stride_inner, H, eps,
    BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < H
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    x_off = _row_offsets(rows, n_inner, stride_outer, stride_inner)
    x = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=mask, other=0.0)
    y = _normalize(x.to(tl.float32), w_ptr, cols, col_mask, H, eps, x.dtype)
    out_off = rows.to(tl.int64)[:, None] * H + cols[None, :]
    tl.store(out_ptr + out_off, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr,
    n_rows, n_inner, x_stride_outer, x_stride_inner, r_stride_outer, r_stride_inner,
    H, eps,
    BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < H
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    x_off = _row_offsets(rows, n_inner, x_stride_outer, x_stride_inner)
    r_off = _row_offsets(rows, n_inner, r_stride_outer, r_stride_inner)
    x = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=mask, other=0.0)
    r = tl.load(r_ptr + r_off[:, None] + cols[None, :], mask=mask, other=0.0)
    # The sum is rounded to the input dtype first, as the reference's `x + residual` is.
    summed = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    y = _normalize(summed.to(tl.float32), w_ptr, cols, col_mask, H, eps, x.dtype)
    out_off = rows.to(tl.int64)[:, None] * H + cols[None, :]
    tl.store(sum_ptr + out_off, summed, mask=mask)
    tl.store(out_ptr + out_off, y.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """A [outer, inner, H] view of x; a copy only for >3-d inputs whose leading dims don't merge."""
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got {x.stride()}")
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(0)
    return x if x.dim() == 3 else x.reshape(-1, *x.shape[-2:])


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype not in FLOAT_DTYPES or weight.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"rms_norm supports {FLOAT_DTYPES}, got x {x.dtype}, weight {weight.dtype}"
        )
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or weight.stride(0) != 1:
        raise ValueError(
            f"weight must be contiguous [{x.shape[-1]}], got {tuple(weight.shape)} "
            f"with strides {weight.stride()}"
        )
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"hidden size {x.shape[-1]} exceeds {MAX_HIDDEN}")


def _grid_rows(n_rows: int, hidden: int, block_elems: int) -> tuple[int, int]:
    block_h = next_power_of_2(hidden)
    block_rows = min(max(1, block_elems // block_h), next_power_of_2(n_rows))
    return block_rows, block_h


def _rms_norm_launch(x, weight, eps, *, block_elems: int, num_warps: int):
    x3 = _as_rows(x, "x")
    hidden = x.shape[-1]
    n_rows = x3.shape[0] * x3.shape[1]
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if n_rows == 0:
        return out
    block_rows, block_h = _grid_rows(n_rows, hidden, block_elems)
    _rms_norm_kernel[(triton.cdiv(n_rows, block_rows),)](
        x3, weight, out, n_rows, x3.shape[1], x3.stride(0), x3.stride(1), hidden, eps,
        BLOCK_ROWS=block_rows, BLOCK_H=block_h, num_warps=num_warps,
    )  # fmt: skip
    return out


def _fused_add_launch(x, residual, weight, eps, *, block_elems: int, num_warps: int):
    x3, r3 = _as_rows(x, "x"), _as_rows(residual, "residual")
    hidden = x.shape[-1]
    n_rows = x3.shape[0] * x3.shape[1]
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return out, summed
    block_rows, block_h = _grid_rows(n_rows, hidden, block_elems)
    _fused_add_rms_norm_kernel[(triton.cdiv(n_rows, block_rows),)](
        x3, r3, weight, out, summed,
        n_rows, x3.shape[1], x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        hidden, eps,
        BLOCK_ROWS=block_rows, BLOCK_H=block_h, num_warps=num_warps,
    )  # fmt: skip
    return out, summed


# block_elems: elements per program; small hidden sizes (per-head norm) pack several rows.
_CONFIGS = [
    {"block_elems": 4096, "num_warps": 4},
    {"block_elems": 4096, "num_warps": 8},
    {"block_elems": 8192, "num_warps": 8},
    {"block_elems": 8192, "num_warps": 16},
    {"block_elems": 16384, "num_warps": 16},
    {"block_elems": 2048, "num_warps": 4},
    {"block_elems": 1024, "num_warps": 2},
]


def _bucket(x, *rest):
    rows = x.numel() // max(1, x.shape[-1])
    return (min(next_power_of_2(rows), 1 << 16), x.shape[-1], str(x.dtype))


_rms_norm_selector = Selector("rms_norm", {"rows": _rms_norm_launch}, {"rows": _CONFIGS}, _bucket)
_fused_add_selector = Selector(
    "fused_add_rms_norm", {"rows": _fused_add_launch}, {"rows": _CONFIGS}, _bucket
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension; output dtype is promote(x, weight) like the reference."""
    _check(x, weight)
    return _rms_norm_selector(x, weight, float(eps))


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual), reading each input once."""
    _check(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual must match x: {tuple(residual.shape)} {residual.dtype} vs "
            f"{tuple(x.shape)} {x.dtype}"
        )
    if residual.device != x.device:
        raise ValueError(f"residual is on {residual.device}, x on {x.device}")
    _as_rows(residual, "residual")
    return _fused_add_selector(x, residual, weight, float(eps))
