"""Triton fused MoE: grouped GEMMs over expert-aligned row blocks.

Pairs (token, k) are sorted by expert and padded to BLOCK_M rows per block
(`moe_align`), so every block multiplies gathered activation rows by one
expert's weights:

1. gate/up: act[pair] = silu(x[token] @ gate_e^T) * (x[token] @ up_e^T), with the
   gate and up columns of one tile accumulated side by side so SiLU-and-mul is
   the epilogue and the [pairs, 2I] projection never reaches memory;
2. down: y[pair] = (act[pair] @ w2_e^T) * routing weight;
3. out[t] = sum_k y[t, k] (a torch sum over [T, k, H], as the reference sums).

Both GEMMs use tl.dot on input-dtype tiles with float32 accumulators; program
ids are swizzled in GROUP_M groups of row blocks so the blocks of one expert
run together and share its weight tiles in L2. Rounding steps follow
`kernels.reference`. No host syncs: decode steps can be graph-captured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.activation import silu_and_mul
from kernels.fused_moe_rows import ROWS_CONFIGS, ROWS_MAX_TOKENS, fused_moe_rows
from kernels.moe_routing import INDEX_DTYPES, check_load, moe_align
from kernels.selection import Selector, next_power_of_2
from kernels.selection_verify import ATTENTION_TOLERANCE, close_outputs

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _block_coords(num_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    return pid_m, pid_n


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, act_ptr, sorted_ptr, expert_ids_ptr,
    num_pairs, num_blocks, WIDTH, stride_xt, stride_we, stride_wn,
    HIDDEN: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _block_coords(num_blocks, WIDTH, BLOCK_N, GROUP_M)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Wrapping the column index keeps the weight loads unmasked; extra columns are not stored.
    cols = offs_n % WIDTH
    a_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + WIDTH * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The reduction length is a model constant, so it is compiled in (static loop bounds).
    EVEN_K: tl.constexpr = HIDDEN % BLOCK_K == 0
    for k in range(0, (HIDDEN + BLOCK_K - 1) // BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_left = HIDDEN - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
            g = tl.load(g_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            u = tl.load(u_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc_g = tl.dot(a, g, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    dtype: tl.constexpr = act_ptr.dtype.element_ty
    # Round where the reference does: projection, SiLU, product.
    gate = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    act = (silu * up).to(dtype)
    out = act_ptr + pairs.to(tl.int64)[:, None] * WIDTH + offs_n[None, :]
    tl.store(out, act, mask=row_mask[:, None] & (offs_n[None, :] < WIDTH))


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, y_ptr, topk_w_ptr, sorted_ptr, expert_ids_ptr,
    num_pairs, num_blocks, HIDDEN, stride_we, stride_wn,
    WIDTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _block_coords(num_blocks, HIDDEN, BLOCK_N, GROUP_M)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    rows = pairs.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = offs_n % HIDDEN
    a_ptrs = act_ptr + rows[:, None] * WIDTH + offs_k[None, :]
    b_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    EVEN_K: tl.constexpr = WIDTH % BLOCK_K == 0
    for k in range(0, (WIDTH + BLOCK_K - 1) // BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            k_left = WIDTH - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    dtype: tl.constexpr = y_ptr.dtype.element_ty
    route_w = tl.load(topk_w_ptr + rows, mask=row_mask, other=0.0).to(dtype).to(tl.float32)
    y = (acc.to(dtype).to(tl.float32) * route_w[:, None]).to(dtype)
    out = y_ptr + rows[:, None] * HIDDEN + offs_n[None, :]
    tl.store(out, y, mask=row_mask[:, None] & (offs_n[None, :] < HIDDEN))


def _launch(
    x, w13, w2, topk_weights, topk_ids, load=None, *,
    block_m, group_m, block_n1, block_k1, warps1, stages1, block_n2, block_k2, warps2, stages2,
):  # fmt: skip
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, width = w2.shape[0], w2.shape[2]
    num_pairs = tokens * top_k
    if num_pairs == 0:
        return torch.zeros(tokens, hidden, dtype=x.dtype, device=x.device)
    sorted_ids, expert_ids, _ = moe_align(topk_ids, num_experts, block_m, load)
    num_blocks = expert_ids.shape[0]
    act = torch.empty(num_pairs, width, dtype=x.dtype, device=x.device)
    # zeros: a pair moe_align dropped (an id outside [0, E)) is never written, adds nothing
    y = torch.zeros(num_pairs, hidden, dtype=x.dtype, device=x.device)
    # Small problems get narrower tiles (tl.dot needs at least 16 on each side).
    block_n1 = max(16, min(block_n1, next_power_of_2(width)))
    block_k1 = max(16, min(block_k1, next_power_of_2(hidden)))
    block_n2 = max(16, min(block_n2, next_power_of_2(hidden)))
    block_k2 = max(16, min(block_k2, next_power_of_2(width)))
    # float32 models get full-precision products, as torch's matmul does by default.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _gate_up_kernel[(num_blocks * triton.cdiv(width, block_n1),)](
        x, w13, act, sorted_ids, expert_ids,
        num_pairs, num_blocks, width, x.stride(0), w13.stride(0), w13.stride(1),
        HIDDEN=hidden, TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n1, BLOCK_K=block_k1,
        GROUP_M=group_m, DOT_PRECISION=precision, num_warps=warps1, num_stages=stages1,
    )  # fmt: skip
    _down_kernel[(num_blocks * triton.cdiv(hidden, block_n2),)](
        act, w2, y, topk_weights, sorted_ids, expert_ids,
        num_pairs, num_blocks, hidden, w2.stride(0), w2.stride(1),
        WIDTH=width, BLOCK_M=block_m, BLOCK_N=block_n2, BLOCK_K=block_k2, GROUP_M=group_m,
        DOT_PRECISION=precision, num_warps=warps2, num_stages=stages2,
    )  # fmt: skip
    if top_k == 1:
        return y
    return y.view(tokens, top_k, hidden).sum(dim=1)


def _grouped(x, w13, w2, topk_weights, topk_ids, load=None, shared=None, **config):
    """The grouped kernels; a shared expert runs beside them (torch and the SiLU kernel)."""
    routed = _launch(x, w13, w2, topk_weights, topk_ids, load, **config)
    if shared is None:
        return routed
    gate_up, down = shared
    return routed + F.linear(silu_and_mul(F.linear(x, gate_up)), down)


def _config(block_m, group_m, gemm1, gemm2) -> dict:
    """gemm1/gemm2: (BLOCK_N, BLOCK_K, num_warps, num_stages) of the gate/up and down GEMMs."""
    cfg = {"block_m": block_m, "group_m": group_m}
    for i, (n, k, warps, stages) in ((1, gemm1), (2, gemm2)):
        cfg.update({f"block_n{i}": n, f"block_k{i}": k, f"warps{i}": warps, f"stages{i}": stages})
    return cfg


# Small-T decode is bound by reading each hit expert's weights once: 16-row blocks,
# narrow N and deep K keep many programs streaming. Large-T prefill is bound by
# tensor-core rate: 64/128-row blocks feed wgmma, grouped so an expert's weight
# tiles are reused from L2 across its blocks.
_CONFIGS = [
    _config(16, 1, (64, 128, 4, 4), (64, 128, 4, 4)),
    _config(16, 1, (32, 256, 4, 4), (32, 256, 4, 3)),
    _config(16, 1, (128, 128, 4, 3), (128, 64, 4, 4)),
    _config(16, 1, (64, 64, 4, 5), (64, 64, 4, 5)),  # ~90 KB smem: two programs per SM
    _config(32, 4, (64, 128, 4, 4), (64, 128, 4, 4)),
    _config(64, 8, (64, 64, 4, 4), (128, 64, 4, 4)),
    _config(64, 8, (128, 64, 8, 3), (128, 64, 4, 4)),
    _config(128, 8, (64, 64, 8, 3), (128, 64, 8, 3)),
    _config(128, 8, (128, 64, 8, 3), (256, 64, 8, 3)),
]


def _bucket(x, w13, w2, topk_weights, topk_ids, load=None, shared=None):
    bucket = (
        min(next_power_of_2(x.shape[0]), 1 << 16), x.shape[1], w2.shape[2], w2.shape[0],
        topk_ids.shape[1], str(x.dtype),
    )  # fmt: skip
    return bucket if shared is None else (*bucket, "shared", shared[1].shape[1])


def _rows_suit(config, x, w13, w2, topk_weights, topk_ids, load=None, shared=None) -> bool:
    """The per-pair kernels are tried for a few tokens only (a bucket holds up to a power
    of two of them), and with a shared expert only one of whole routed widths."""
    whole = shared is None or shared[1].shape[1] % w2.shape[2] == 0
    return whole and next_power_of_2(x.shape[0]) <= ROWS_MAX_TOKENS


def _tune_args(args: tuple) -> tuple:
    """Tuning runs every candidate: they count into a scratch load, not the experts' own."""
    *inputs, load, shared = args
    return (*inputs, None if load is None else torch.zeros_like(load), shared)


_selector = Selector(
    "fused_moe",
    {"grouped": _grouped, "rows": fused_moe_rows},
    {"grouped": _CONFIGS, "rows": ROWS_CONFIGS},
    _bucket,
    applies={"rows": _rows_suit},
    tune_args=_tune_args,
    # a candidate whose output parts from the first's (the grouped kernels') is dropped
    verify=close_outputs(ATTENTION_TOLERANCE),
    revision="s74",  # the per-pair kernels are new candidates for a few tokens
)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    load: torch.Tensor | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Routed experts: sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)) -> [T, H] in x's dtype.

    x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_weights float
    [T, k]; topk_ids int32 or int64 [T, k]: a pair whose id lies outside [0, E) adds
    nothing (an expert service's partial sum over the experts it holds).
    load, if given (int64 [E], contiguous), gets each expert's number of pairs added (the
    counters expert balancing reads), inside the kernels. shared, if given (gate_up [2S, H]
    gate rows then up rows, down [H, S], contiguous): an always-on expert whose output is
    added (a DeepSeek layer's shared experts), inside the per-pair kernels where S is a
    multiple of I, beside the grouped ones.
    """
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"expected x [T, H], w13 [E, 2I, H], w2 [E, H, I], got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")  # fmt: skip
    tokens, hidden = x.shape
    experts, width = w2.shape[0], w2.shape[2]
    if tuple(w13.shape) != (experts, 2 * width, hidden) or w2.shape[1] != hidden:
        raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit hidden "
                         f"{hidden}: need w13 [E, 2I, H] and w2 [E, H, I]")  # fmt: skip
    if x.dtype not in FLOAT_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"x, w13, w2 must share a dtype in {FLOAT_DTYPES}, got "
                         f"{x.dtype}, {w13.dtype}, {w2.dtype}")  # fmt: skip
    if x.stride(1) != 1 or not w13.is_contiguous() or not w2.is_contiguous():
        raise ValueError("x needs unit last stride and w13, w2 must be contiguous")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or topk_ids.dtype not in INDEX_DTYPES:
        raise ValueError(f"topk_ids must be int32/int64 [{tokens}, k], got "
                         f"{topk_ids.dtype} {tuple(topk_ids.shape)}")  # fmt: skip
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype not in FLOAT_DTYPES:
        raise ValueError(f"topk_weights must be float {tuple(topk_ids.shape)}, got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")  # fmt: skip
    if not topk_ids.is_contiguous() or not topk_weights.is_contiguous():
        raise ValueError("topk_ids and topk_weights must be contiguous")
    for name, t in (("w13", w13), ("w2", w2), ("topk_weights", topk_weights),
                    ("topk_ids", topk_ids)):  # fmt: skip
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    check_load(load, experts, x.device)
    if shared is not None:
        _check_shared(shared, x)
    return _selector(x, w13, w2, topk_weights, topk_ids, load, shared)


def _check_shared(shared, x: torch.Tensor) -> None:
    gate_up, down = shared
    hidden = x.shape[1]
    if gate_up.dim() != 2 or down.dim() != 2 or down.shape[0] != hidden:
        raise ValueError(f"shared must be (gate_up [2S, {hidden}], down [{hidden}, S]), got "
                         f"{tuple(gate_up.shape)}, {tuple(down.shape)}")  # fmt: skip
    if tuple(gate_up.shape) != (2 * down.shape[1], hidden):
        raise ValueError(f"shared gate_up {tuple(gate_up.shape)} does not fit down "
                         f"{tuple(down.shape)}: need [2S, H] and [H, S]")  # fmt: skip
    for name, t in (("shared gate_up", gate_up), ("shared down", down)):
        if t.dtype != x.dtype or t.device != x.device or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous {x.dtype} on {x.device}, got "
                             f"{t.dtype} on {t.device}")  # fmt: skip
