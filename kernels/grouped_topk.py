"""Triton DeepSeek routing: scores, group selection, top-k, renormalisation and
scaling in one kernel (see `kernels.reference.grouped_topk` for the meaning).

Rows of tokens per program, every expert of a row in registers. Groups are
contiguous runs of experts; each group's rank (its best score for V2, the sum
of its two best biased scores for V3's noaux_tc) is found by one masked pass
per group, so the expert count need not be a power of two. Experts of dropped
groups are masked with -inf. Ties go to the lowest expert / group id. Nothing
is read back to the host: the op can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe_routing import ROWWISE_CONFIGS, check_router_layout, routing_outputs
from kernels.selection import Selector, next_power_of_2


@triton.jit
def _best(x, cols, BLOCK_E: tl.constexpr):
    """Per row: the largest value and the lowest column holding it."""
    best = tl.max(x, axis=1)
    idx = tl.min(tl.where(x == best[:, None], cols[None, :], BLOCK_E), axis=1)
    return best, idx


@triton.jit
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, T, E, stride_t, scaling,
    TOP_K: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
    SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    col_ok = cols < E
    ptrs = logits_ptr + rows.to(tl.int64)[:, None] * stride_t + cols[None, :]
    x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    neg_inf = float("-inf")
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        choice = scores + bias[None, :]
    else:
        x = tl.where(col_ok[None, :], x, neg_inf)
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        scores = e / tl.sum(e, axis=1)[:, None]
        choice = scores
    choice = tl.where(col_ok[None, :], choice, neg_inf)
    if NUM_GROUPS > 1:
        group_size = E // NUM_GROUPS
        group_of = cols // group_size  # padding columns fall past the last group
        g_cols = tl.arange(0, BLOCK_G)
        ranks = tl.full((BLOCK_T, BLOCK_G), neg_inf, dtype=tl.float32)
        for g in tl.static_range(NUM_GROUPS):
            member = group_of[None, :] == g
            in_group = tl.where(member, choice, neg_inf)
            top, top_idx = _best(in_group, cols, BLOCK_E)
            if SIGMOID:  # noaux_tc: the sum of the group's two best
                second = tl.max(tl.where(cols[None, :] == top_idx[:, None], neg_inf, in_group), 1)
                top = top + second
            ranks = tl.where(g_cols[None, :] == g, top[:, None], ranks)
        kept = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            _, g_idx = _best(ranks, g_cols, BLOCK_G)
            kept = kept | (group_of[None, :] == g_idx[:, None])
            ranks = tl.where(g_cols[None, :] == g_idx[:, None], neg_inf, ranks)
        choice = tl.where(kept, choice, neg_inf)
    k_cols = tl.arange(0, BLOCK_K)[None, :]
    top_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        _, idx = _best(choice, cols, BLOCK_E)
        taken = cols[None, :] == idx[:, None]
        weight = tl.sum(tl.where(taken, scores, 0.0), axis=1)  # the unbiased score
        top_w = tl.where(k_cols == i, weight[:, None], top_w)
        top_i = tl.where(k_cols == i, idx[:, None], top_i)
        # top_k <= the kept experts (checked), so a finite choice always remains.
        choice = tl.where(taken, neg_inf, choice)
    if RENORMALIZE:
        top_w = top_w / (tl.sum(top_w, axis=1)[:, None] + 1e-20)
    top_w = top_w * scaling
    out = rows.to(tl.int64)[:, None] * TOP_K + k_cols
    mask = row_ok[:, None] & (k_cols < TOP_K)
    tl.store(weights_ptr + out, top_w, mask=mask)
    tl.store(ids_ptr + out, top_i.to(ids_ptr.dtype.element_ty), mask=mask)


def _launch(logits, top_k, num_groups, topk_group, renormalize, scaling, scoring, bias, *,
            block_t: int, num_warps: int):  # fmt: skip
    tokens, experts = logits.shape
    weights, ids = routing_outputs(logits, top_k)
    if tokens == 0:
        return weights, ids
    block_t = min(block_t, next_power_of_2(tokens))
    sigmoid = scoring == "sigmoid"
    _grouped_topk_kernel[(triton.cdiv(tokens, block_t),)](
        logits, bias if sigmoid else logits, weights, ids, tokens, experts, logits.stride(0),
        float(scaling),
        TOP_K=top_k, NUM_GROUPS=num_groups, TOPK_GROUP=topk_group, SIGMOID=sigmoid,
        RENORMALIZE=bool(renormalize), BLOCK_T=block_t,
        BLOCK_E=max(16, next_power_of_2(experts)), BLOCK_K=next_power_of_2(top_k),
        BLOCK_G=max(2, next_power_of_2(num_groups)), num_warps=num_warps,
    )  # fmt: skip
    return weights, ids


_selector = Selector(
    "grouped_topk",
    {"rowwise": _launch},
    {"rowwise": ROWWISE_CONFIGS},
    lambda logits, top_k, groups, kept, renormalize, scaling, scoring, bias: (
        min(next_power_of_2(logits.shape[0]), 1 << 16),
        logits.shape[1],
        top_k,
        groups,
        kept,
        scoring,
        str(logits.dtype),
    ),
)


def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_group: int,
    renormalize: bool,
    scaling: float,
    scoring: str = "softmax",
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek routing in one kernel: (weights float32 [T, k], expert ids int64 [T, k]),
    ordered by decreasing choice score."""
    if router_logits.dim() != 2 or not router_logits.is_floating_point():
        raise ValueError(f"router_logits must be float [T, E], got {router_logits.dtype} "
                         f"{tuple(router_logits.shape)}")  # fmt: skip
    experts = check_router_layout(router_logits)
    if not isinstance(num_groups, int) or num_groups < 1 or experts % num_groups:
        raise ValueError(f"num_groups must be a positive int dividing {experts}, got "
                         f"{num_groups!r}")  # fmt: skip
    if not isinstance(topk_group, int) or not 1 <= topk_group <= num_groups:
        raise ValueError(f"topk_group must be an int in [1, {num_groups}], got {topk_group!r}")
    kept = topk_group * (experts // num_groups)
    if not isinstance(top_k, int) or not 1 <= top_k <= kept:
        raise ValueError(f"top_k must be an int in [1, {kept}] (the kept groups' experts), "
                         f"got {top_k!r}")  # fmt: skip
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    if scoring == "sigmoid":
        if num_groups > 1 and experts // num_groups < 2:
            raise ValueError("sigmoid (noaux_tc) routing ranks groups by their two best "
                             "experts: each group needs at least 2")  # fmt: skip
        bias = correction_bias
        if bias is None or bias.shape != (experts,) or bias.device != router_logits.device:
            raise ValueError(f"sigmoid routing needs a correction_bias [{experts}] on "
                             f"{router_logits.device}")  # fmt: skip
        if not bias.is_contiguous() or not bias.is_floating_point():
            raise ValueError("correction_bias must be a contiguous float tensor")
    return _selector(router_logits, top_k, num_groups, topk_group, bool(renormalize),
                     float(scaling), scoring, correction_bias)  # fmt: skip
