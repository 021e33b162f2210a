"""A few rows times a weight matrix (decode's projections at batch 1 to 16):
out [M, N] = x [M, K] @ w [N, K]^T, read as a stream of the weight.

At a few rows a projection is bound by reading its weight once; the time goes
into how many programs share that stream and how little each waits. Two kernels,
each program a block of the weight's rows over all of K, float32 accumulation,
one rounding at the end (as cuBLAS rounds):

- `fma`: for 1 to 4 rows, products summed along K in registers (no tensor-core
  padding), so blocks as narrow as 4 weight rows keep every SM streaming even for
  a 576-row projection;
- `dot`: for up to 16 rows, tl.dot on the rows padded to 16.

Whether either beats cuBLAS at a shape is measured (bench.gpu.skinny_gemm), and the
engine's choice at each shape is timed as a decode step reads the weight: out of the
L2 cache (`cold_cuda_timer`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.selection import Selector, cold_cuda_timer, next_power_of_2
from kernels.selection_verify import ATTENTION_TOLERANCE, close_outputs

MAX_ROWS = 16
FMA_MAX_ROWS = 4
MAX_PRODUCTS = 8192  # an fma program's [M, N, K] products beyond this spill
# 16-bit rows against a float32 weight (a router kept in float32): the rows are upcast.
MIXED = {torch.float32: (torch.bfloat16, torch.float16)}


@triton.jit
def _skinny_fma_kernel(
    x_ptr, w_ptr, out_ptr, M, N, stride_xm, stride_wn, stride_om,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = (offs_n % N).to(tl.int64)  # wrapped: unmasked weight loads; extras not stored
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    EVEN_K: tl.constexpr = K % BLOCK_K == 0
    for k in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=offs_m[:, None] < M, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs).to(tl.float32)
        else:
            k_mask = offs_k < K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0).to(tl.float32)
            x = x.to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n < N))


@triton.jit
def _skinny_dot_kernel(
    x_ptr, w_ptr, out_ptr, M, N, stride_xm, stride_wn, stride_om,
    K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    offs_m = tl.arange(0, 16)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = (offs_n % N).to(tl.int64)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rows[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    EVEN_K: tl.constexpr = K % BLOCK_K == 0
    for k in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=offs_m[:, None] < M, other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_mask = offs_k < K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        acc = tl.dot(x.to(w.dtype), w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n < N))


def check_skinny(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    rows, k = x.shape
    if not 1 <= rows <= MAX_ROWS or w.dim() != 2 or w.shape[1] != k:
        raise ValueError(f"need x [1..{MAX_ROWS}, K] and w [N, K], got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}")  # fmt: skip
    if x.stride(1) != 1 or w.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("x, w and out need unit last strides")
    if out.shape != (rows, w.shape[0]) or x.dtype not in (w.dtype, *MIXED.get(w.dtype, ())):
        raise ValueError(f"out must be [{rows}, {w.shape[0]}] and x {w.dtype} (or 16-bit with "
                         f"a float32 w), got {tuple(out.shape)} and {x.dtype}")  # fmt: skip


def skinny_fma(x, w, out, *, block_n: int, block_k: int, num_warps: int, num_stages: int):
    """out [M, N] = x @ w^T for M <= 4 (rows summed in registers); returns out."""
    check_skinny(x, w, out)
    rows, k = x.shape
    if rows > FMA_MAX_ROWS:
        raise ValueError(f"skinny_fma takes at most {FMA_MAX_ROWS} rows, got {rows}")
    n = w.shape[0]
    _skinny_fma_kernel[(triton.cdiv(n, block_n),)](
        x, w, out, rows, n, x.stride(0), w.stride(0), out.stride(0),
        K=k, BLOCK_M=triton.next_power_of_2(rows), BLOCK_N=block_n,
        BLOCK_K=min(block_k, triton.next_power_of_2(k)),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def skinny_dot(x, w, out, *, block_n: int, block_k: int, num_warps: int, num_stages: int):
    """out [M, N] = x @ w^T for M <= 16 (tl.dot on 16 padded rows); returns out."""
    check_skinny(x, w, out)
    rows, k = x.shape
    n = w.shape[0]
    _skinny_dot_kernel[(triton.cdiv(n, block_n),)](
        x, w, out, rows, n, x.stride(0), w.stride(0), out.stride(0),
        K=k, BLOCK_N=max(16, block_n), BLOCK_K=max(16, min(block_k, triton.next_power_of_2(k))),
        DOT_PRECISION="ieee" if w.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def _configs(pairs, warps, stages) -> list[dict]:
    return [dict(block_n=n, block_k=k, num_warps=w, num_stages=s)
            for n, k in pairs for w in warps for s in stages]  # fmt: skip


# Every config bench.gpu.skinny_gemm times ((block_n, block_k): at most 8,192 products in
# flight an fma program at one row; 4 rows then take 4-row blocks).
FMA_SWEEP = _configs([(4, 512), (8, 256), (8, 512), (16, 256), (16, 512), (32, 128)],
                     (2, 4), (3, 4))  # fmt: skip
DOT_SWEEP = _configs([(16, 256), (32, 128), (32, 256), (64, 128)], (4,), (3, 4, 5))
# The engine's candidates, a few so a shape first met compiles little (provisional: the
# sweep on the GPU picks them).
FMA_CONFIGS = _configs([(4, 512), (8, 512), (16, 256), (32, 128)], (4,), (3,))
DOT_CONFIGS = _configs([(32, 256), (64, 128)], (4,), (4,))


def _torch_mm(x, w, out):
    return torch.mm(x.to(w.dtype), w.t(), out=out)


def _bucket(x, w, out):
    return (next_power_of_2(x.shape[0]), w.shape[0], x.shape[1], str(x.dtype), str(out.dtype))


def _fma_suits(config, x, w, out) -> bool:
    """Up to 4 rows, and no more products in flight a program than MAX_PRODUCTS."""
    rows = next_power_of_2(x.shape[0])
    return rows <= FMA_MAX_ROWS and rows * config["block_n"] * config["block_k"] <= MAX_PRODUCTS


SELECTOR = Selector(
    "skinny_linear",
    {"torch": _torch_mm, "fma": skinny_fma, "dot": skinny_dot},
    {"fma": FMA_CONFIGS, "dot": DOT_CONFIGS},
    _bucket,
    applies={"fma": _fma_suits},
    # a candidate whose product parts from cuBLAS's is dropped, never chosen
    verify=close_outputs(ATTENTION_TOLERANCE),
    # timed with the weight out of the L2 cache, as a decode step reads it: back to back
    # (the choices of revision ""), weights the L2 holds were read at its speed
    timer=cold_cuda_timer,
    revision="cold",
)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.reference.linear (x @ w^T + bias in w's dtype) for x [T, K]: for 1 to 16 rows
    on CUDA without a bias, the fastest of cuBLAS and the kernels above at this shape (tuned
    on first use); a float32 w takes 16-bit rows without a cast of its own. Anything else
    (shapes that do not fit included: torch's error) goes to F.linear."""
    mixed = x.dtype != w.dtype
    if (bias is not None or x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or not x.is_cuda
            or w.dim() != 2 or w.shape[1] != x.shape[1] or w.device != x.device
            or x.stride(1) != 1 or w.stride(1) != 1
            or (mixed and x.dtype not in MIXED.get(w.dtype, ()))):  # fmt: skip
        return F.linear(x.to(w.dtype) if mixed else x, w, bias)
    out = torch.empty(x.shape[0], w.shape[0], dtype=w.dtype, device=x.device)
    return SELECTOR(x, w, out)
