"""Fused MoE for a few tokens: each (token, k) pair streams its expert's weights
as a matrix-vector product, with no sorting by expert and no separate top-k sum.

A decode step of one to a few sequences hits each expert with one row, so the
grouped kernels' 16-row tiles (`kernels.fused_moe`) are mostly padding, and they
need the alignment kernel before and the [T, k, H] sum after. Here:

1. gate/up: one program per (pair, block of I columns) reads x[token] and the
   block's gate and up rows of expert ids[pair]; SiLU-and-mul is the epilogue;
   the program of a pair's first block adds 1 to that expert's load counter
   (when one is given);
2. down and sum: one program per (token, block of H columns) loops over the
   token's k experts, rounds each one's product and routing weight as the
   grouped path does, and sums them in float32 into out[token].

Both accumulate in float32 over a K loop of BLOCK_K elements; rounding steps
follow `kernels.reference`. No host syncs: graph-capturable. Ids outside [0, E)
contribute nothing (and are not counted).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gate_up_rows(x_ptrs, g_ptrs, up_offset, HIDDEN: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):  # fmt: skip
    """One row's gate and up projections over a block of columns, float32."""
    offs_k = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    EVEN_K: tl.constexpr = HIDDEN % BLOCK_K == 0
    for k in range(0, (HIDDEN + BLOCK_K - 1) // BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs).to(tl.float32)
            g = tl.load(g_ptrs).to(tl.float32)
            u = tl.load(g_ptrs + up_offset).to(tl.float32)
        else:
            k_mask = offs_k < HIDDEN - k * BLOCK_K
            a = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
            g = tl.load(g_ptrs, mask=k_mask[None, :], other=0.0).to(tl.float32)
            u = tl.load(g_ptrs + up_offset, mask=k_mask[None, :], other=0.0).to(tl.float32)
        acc_g += tl.sum(g * a[None, :], axis=1)
        acc_u += tl.sum(u * a[None, :], axis=1)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
    return acc_g, acc_u


@triton.jit
def _rows_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, ids_ptr, act_ptr, load_ptr, E, WIDTH, stride_xt, stride_we, stride_wn,
    HIDDEN: tl.constexpr, TOP_K: tl.constexpr, N_SHARED: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, COUNT: tl.constexpr,
):  # fmt: skip
    # Programs [0, T * k) take the routed pairs, the rest each token's shared chunks: chunk
    # c of a shared expert of width N_SHARED * WIDTH is its gate and up rows
    # [c * WIDTH, (c + 1) * WIDTH) (s_ptr: [2 * N_SHARED * WIDTH, HIDDEN], gate then up).
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_routed = tl.num_programs(0) // (TOP_K + N_SHARED) * TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = offs_n % WIDTH  # wrapped: the weight loads stay unmasked along N
    offs_k = tl.arange(0, BLOCK_K)
    if pair < num_routed:
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        valid = (expert >= 0) & (expert < E)
        if COUNT:
            if pid_n == 0:
                tl.atomic_add(load_ptr + expert, 1, mask=valid, sem="relaxed")
        token = (pair // TOP_K).to(tl.int64)
        base = w_ptr + tl.where(valid, expert, 0) * stride_we
        # (a stride of 1 would arrive as a constexpr: built as a tensor on both branches)
        row_stride = tl.full([], 0, tl.int64) + stride_wn
    else:
        CHUNKS: tl.constexpr = N_SHARED + (N_SHARED == 0)  # never 0 (no shared: unused)
        token = ((pair - num_routed) // CHUNKS).to(tl.int64)
        chunk = ((pair - num_routed) % CHUNKS).to(tl.int64)
        valid = pair >= 0
        base = s_ptr + chunk * WIDTH * HIDDEN
        row_stride = tl.full([], HIDDEN, tl.int64)
    # up rows follow the gate rows: WIDTH of an expert's, N_SHARED * WIDTH of the shared one's
    up_offset = tl.where(pair < num_routed, WIDTH, N_SHARED * WIDTH) * row_stride
    g_ptrs = base + cols[:, None] * row_stride + offs_k[None, :]
    x_ptrs = x_ptr + token * stride_xt + offs_k
    acc_g, acc_u = _gate_up_rows(x_ptrs, g_ptrs, up_offset, HIDDEN, BLOCK_N, BLOCK_K)
    dtype: tl.constexpr = act_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    act = tl.where(valid, silu * up, 0.0).to(dtype)
    tl.store(act_ptr + pair.to(tl.int64) * WIDTH + offs_n, act, mask=offs_n < WIDTH)


@triton.jit
def _down_row(a_ptrs, b_ptrs, WIDTH: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):  # fmt: skip
    """One row's down projection over a block of output columns, float32."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    EVEN_K: tl.constexpr = WIDTH % BLOCK_K == 0
    for k in range(0, (WIDTH + BLOCK_K - 1) // BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs).to(tl.float32)
            b = tl.load(b_ptrs).to(tl.float32)
        else:
            k_mask = offs_k < WIDTH - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_mask, other=0.0).to(tl.float32)
            b = tl.load(b_ptrs, mask=k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(b * a[None, :], axis=1)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


@triton.jit
def _rows_down_sum_kernel(
    act_ptr, w_ptr, d_ptr, ids_ptr, topk_w_ptr, out_ptr, E, HIDDEN, stride_we, stride_wn,
    stride_ot, WIDTH: tl.constexpr, TOP_K: tl.constexpr, N_SHARED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    cols = offs_n % HIDDEN
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        valid = (expert >= 0) & (expert < E)
        b_ptrs = (w_ptr + tl.where(valid, expert, 0) * stride_we + cols[:, None] * stride_wn
                  + offs_k[None, :])  # fmt: skip
        acc = _down_row(act_ptr + pair * WIDTH + offs_k, b_ptrs, WIDTH, BLOCK_N, BLOCK_K)
        route_w = tl.load(topk_w_ptr + pair).to(dtype).to(tl.float32)
        y = (acc.to(dtype).to(tl.float32) * route_w).to(dtype).to(tl.float32)
        total += tl.where(valid, y, 0.0)
    if N_SHARED > 0:
        # The shared expert's down projection (d_ptr: [HIDDEN, N_SHARED * WIDTH]) over its
        # chunks, one float32 sum rounded once, added as the reference adds it.
        first = tl.num_programs(0).to(tl.int64) * TOP_K + token * N_SHARED
        shared = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for c in tl.static_range(N_SHARED):
            b_ptrs = d_ptr + cols[:, None] * (N_SHARED * WIDTH) + c * WIDTH + offs_k[None, :]
            a_ptrs = act_ptr + (first + c) * WIDTH + offs_k
            shared += _down_row(a_ptrs, b_ptrs, WIDTH, BLOCK_N, BLOCK_K)
        total = total.to(dtype).to(tl.float32) + shared.to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + offs_n, total.to(dtype), mask=offs_n < HIDDEN)


def shared_chunks(shared, width: int) -> int:
    """How many routed-width chunks a shared expert (gate_up [2S, H], down [H, S]) is: S /
    width (0 where there is none); raises where S is not a multiple of the routed width."""
    if shared is None:
        return 0
    size = shared[1].shape[1]
    if size % width:
        raise ValueError(f"the per-pair kernels take a shared expert whose width is a "
                         f"multiple of the routed one ({width}), got {size}")  # fmt: skip
    return size // width


def fused_moe_rows(
    x, w13, w2, topk_weights, topk_ids, load=None, shared=None, *,
    block_n1: int, block_k1: int, warps1: int, stages1: int,
    block_n2: int, block_k2: int, warps2: int, stages2: int,
):  # fmt: skip
    """kernels.fused_moe's operator (inputs checked there) as per-pair matrix-vector
    products; load (int64 [E]) gets each expert's pair count added, if given; a shared
    expert (gate_up [2S, H], down [H, S], S a multiple of I) is added as the reference
    adds it."""
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, width = w2.shape[0], w2.shape[2]
    chunks = shared_chunks(shared, width)
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    gate_up, down = shared if chunks else (w13, w2)
    act = torch.empty(tokens * (top_k + chunks), width, dtype=x.dtype, device=x.device)
    # Narrow problems get narrower tiles.
    block_n1 = min(block_n1, triton.next_power_of_2(width))
    block_k1 = min(block_k1, triton.next_power_of_2(hidden))
    block_n2 = min(block_n2, triton.next_power_of_2(hidden))
    block_k2 = min(block_k2, triton.next_power_of_2(width))
    count = load is not None
    _rows_gate_up_kernel[(tokens * (top_k + chunks), triton.cdiv(width, block_n1))](
        x, w13, gate_up, topk_ids, act, load if count else topk_ids, num_experts, width,
        x.stride(0), w13.stride(0), w13.stride(1),
        HIDDEN=hidden, TOP_K=top_k, N_SHARED=chunks, BLOCK_N=block_n1, BLOCK_K=block_k1,
        COUNT=count, num_warps=warps1, num_stages=stages1,
    )  # fmt: skip
    _rows_down_sum_kernel[(tokens, triton.cdiv(hidden, block_n2))](
        act, w2, down, topk_ids, topk_weights, out, num_experts, hidden, w2.stride(0),
        w2.stride(1), out.stride(0), WIDTH=width, TOP_K=top_k, N_SHARED=chunks,
        BLOCK_N=block_n2, BLOCK_K=block_k2, num_warps=warps2, num_stages=stages2,
    )  # fmt: skip
    return out


def _config(gemm1, gemm2) -> dict:
    """gemm1/gemm2: (BLOCK_N, BLOCK_K, num_warps, num_stages) of the gate/up and down parts."""
    cfg = {}
    for i, (n, k, warps, stages) in ((1, gemm1), (2, gemm2)):
        cfg.update({f"block_n{i}": n, f"block_k{i}": k, f"warps{i}": warps, f"stages{i}": stages})
    return cfg


# Many narrow programs keep the weight streams of a few pairs spread over every SM:
# V2-Lite's 6 pairs x 1,408 columns at 16 a block are 528 programs of 128 KB each.
ROWS_CONFIGS = [
    _config((16, 256, 4, 3), (16, 256, 4, 3)),
    _config((32, 128, 4, 4), (32, 128, 4, 4)),
    _config((16, 512, 8, 3), (16, 512, 8, 3)),
    _config((32, 256, 8, 3), (8, 512, 4, 3)),
    _config((8, 512, 4, 3), (32, 256, 8, 3)),
]
# At most this many tokens are tried on these kernels (their weight reads grow with the
# tokens, the grouped kernels' barely).
ROWS_MAX_TOKENS = 16
