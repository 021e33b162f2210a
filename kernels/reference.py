"""Pure-torch references for the engine's layer operators.

They define what each operator computes (in the same precision steps as the
Hugging Face models, so float32 outputs match them closely) and are what the
engine runs on CPU. The Triton kernels are tested against these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up on the fused [.., 2 * width] gate/up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding (the Hugging Face Llama convention).

    q: [T, Hq, D], k: [T, Hk, D], positions: [T], cos_sin: [max_pos, D] holding
    cos in the first D/2 columns and sin in the last D/2.
    """
    half = cos_sin.shape[-1] // 2
    cs = cos_sin.index_select(0, positions)
    cos = cs[:, :half].repeat(1, 2).unsqueeze(1).to(q.dtype)
    sin = cs[:, half:].repeat(1, 2).unsqueeze(1).to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotary_cache_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k, stores k and v at their cache slots; returns the rotated (q, k)."""
    q, k = apply_rotary(q, k, positions, cos_sin)
    write_kv_cache(k, v, cache, slot_mapping)
    return q, k


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Stores new keys and values at their slots.

    cache: [num_blocks, 2, block_size, kv_heads, head_dim]; slot = block * block_size + offset.
    """
    block_size = cache.shape[2]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    cache[blocks, 0, offsets] = k.to(cache.dtype)
    cache[blocks, 1, offsets] = v.to(cache.dtype)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A projection: x @ w^T (+ bias) in w's dtype (x is cast to it, as a float32 router
    takes 16-bit hidden states)."""
    return F.linear(x.to(w.dtype) if x.dtype != w.dtype else x, w, bias)


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in float32, top-k, optional renormalisation. Returns (weights, expert ids)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    load: torch.Tensor | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Routed experts: sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)), plus a shared
    expert's down(silu(gate(x)) * up(x)) if given (gate_up [2S, H], down [H, S]).

    x: [T, H]; w13: [E, 2I, H] (gate rows then up rows); w2: [E, H, I].
    Tokens are grouped by expert so each expert runs one matmul. load (int64 [E]), if
    given, gets each expert's number of pairs added. A pair whose id lies outside
    [0, E) adds nothing (an expert service's partial sum over the experts it holds).
    """
    tokens, top_k = topk_ids.shape
    experts = w13.shape[0]
    flat_ids = topk_ids.reshape(-1)
    # an id outside [0, E) is a pair of an expert held elsewhere: it adds nothing
    flat_ids = torch.where((flat_ids >= 0) & (flat_ids < experts), flat_ids, experts)
    if load is not None:
        held = flat_ids[flat_ids < experts]
        load.index_add_(0, held, torch.ones_like(held, dtype=load.dtype))
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=experts + 1)[:experts].tolist()
    token_of = order // top_k
    out = torch.zeros(tokens * top_k, x.shape[-1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start : start + count]
        h = silu_and_mul(x[token_of[start : start + count]] @ w13[expert].t())
        out[rows] = h @ w2[expert].t()
        start += count
    routed = moe_sum(out.view(tokens, top_k, -1), topk_weights)
    if shared is None:
        return routed
    return routed + silu_and_mul(x @ shared[0].t()) @ shared[1].t()


def moe_sum(pair_out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """sum_k w_k * out_k: [T, k, H] expert outputs, [T, k] weights -> [T, H]. Remote
    experts (services/expert_parallel) return unweighted outputs; the worker ends with this."""
    return (pair_out * topk_weights.to(pair_out.dtype).unsqueeze(-1)).sum(dim=1)


def copy_blocks(
    src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int]
) -> None:
    """dst[dst_ids] = src[src_ids]: whole KV blocks of one layer (dim 0 is the block)."""
    if src_ids:
        dst[list(dst_ids)] = src[list(src_ids)].to(dst.device)


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
    """DeepSeek routing, in float32. Returns (weights [T, k], expert ids int64 [T, k]).

    softmax (V2): scores = softmax(logits); groups ranked by their best score.
    sigmoid (V3 noaux_tc): scores = sigmoid(logits); the choice uses scores +
    correction_bias, groups ranked by the sum of their two best biased scores; the
    weights are the unbiased scores. Then: the topk_group best groups are kept, the
    top_k experts among them chosen, weights optionally renormalised (sum + 1e-20)
    and multiplied by `scaling`.

    Experts of dropped groups are masked with -inf, as transformers >= 5 (its
    DeepseekV3TopkRouter), vLLM and SGLang do. Masking with 0.0 (older transformers)
    differs exactly when a kept group's biased scores go negative: a 0.0 then outranks
    them and an expert of a dropped group is chosen.
    """
    logits = router_logits.float()
    if scoring == "sigmoid":
        scores = logits.sigmoid()
        choice = scores + correction_bias.float()
    elif scoring == "softmax":
        scores = choice = torch.softmax(logits, dim=-1)
    else:
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    tokens, experts = choice.shape
    if num_groups > 1:
        grouped = choice.view(tokens, num_groups, experts // num_groups)
        if scoring == "sigmoid":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        kept = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        expert_mask = group_mask.repeat_interleave(experts // num_groups, dim=1)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids
