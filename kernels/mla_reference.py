"""Pure-torch multi-head latent attention (DeepSeek MLA): what the MLA kernels
must compute.

The paged cache holds one entry per token and layer, [latent (C) | k_pe (R)]:
the RMSNorm'd compressed KV and the rotated shared rotary key, in a cache
[num_blocks, 1, block_size, 1, C + R]. Two forms of attention read it:

- absorbed (decode): W_UK is folded into the query (q_latent = W_UK^T q_nope),
  so every head attends over the latents themselves; an MQA with C + R wide
  keys whose values are the first C columns of the same entries. The output
  is still in latent space (W_UV is applied after);
- expanded (prefill/extend): the latents are expanded into per-head keys and
  values and attention is the usual causal one, keys qk_nope + R wide, values
  v_head_dim wide.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import reference


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): adjacent rotary pairs (DeepSeek's
    layout) become neox halves. Applied to queries and keys alike it leaves every q . k
    unchanged, so the cache can keep the neox layout."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


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
    """Rotates q_pe [T, H, R] and k_pe [T, 1, R] (neox layout out, also for interleaved
    input), stores [latent [T, C] | rotated k_pe] at each token's cache slot (the latent
    RMS-normalised first where norm_weight is given). Returns the rotated (q_pe, k_pe), new
    tensors: the op is idempotent, so a tuner may time it."""
    if norm_weight is not None:
        latent = reference.rms_norm(latent, norm_weight, eps)
    if interleaved:
        q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
    q_rot, k_rot = reference.apply_rotary(q_pe, k_pe, positions, cos_sin)
    write_latent_cache(latent, k_rot[:, 0], cache, slot_mapping)
    return q_rot, k_rot


def write_latent_cache(
    latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """cache [num_blocks, 1, block_size, 1, C + R]; slot = block * block_size + offset."""
    entries = cache.view(-1, cache.shape[-1])
    entries[slot_mapping] = torch.cat([latent, k_pe], dim=-1).to(cache.dtype)


def gather_latents(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The cache entries at these slots: [len(slots), C + R]."""
    return cache.view(-1, cache.shape[-1]).index_select(0, slots)


def mla_decode(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Absorbed attention of one query token per sequence over its paged latents.

    q_latent [B, H, C] (W_UK^T q_nope), q_pe [B, H, R] rotated; seq_lens [B] on the device
    (a row of length 0, padding, gives zeros). Returns the latent output [B, H, C] in
    q's dtype: sum_j p_j latent_j, p = softmax(scale * (q_latent . latent + q_pe . k_pe)).
    """
    batch, _, latent_dim = q_latent.shape
    width = cache.shape[-1]
    entries = cache[block_tables.long()].reshape(batch, -1, width).float()  # [B, L, C + R]
    q = torch.cat([q_latent, q_pe], dim=-1).float()
    scores = torch.einsum("bhd,bld->bhl", q, entries) * scale
    positions = torch.arange(entries.shape[1], device=q.device)
    valid = positions[None, :] < seq_lens.long()[:, None]  # [B, L]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an empty row: zeros
    out = torch.einsum("bhl,blc->bhc", probs, entries[..., :latent_dim])
    return out.to(q_latent.dtype)


def mla_extend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    query_lens: list[int],
    prefix_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Expanded causal attention, sequence by sequence.

    q, k [T, H, Dqk] and v [T, H, Dv]: the step's new tokens, sequence i owning
    query_lens[i] consecutive rows; k_prefix [P, H, Dqk], v_prefix [P, H, Dv]: each
    sequence's cached prefix (prefix_lens[i] rows, in the same order), expanded from
    its latents. Returns [T, H, Dv].
    """
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    start = pre = 0
    for n, p in zip(query_lens, prefix_lens):
        keys = torch.cat([k_prefix[pre : pre + p], k[start : start + n]])
        values = torch.cat([v_prefix[pre : pre + p], v[start : start + n]])
        # [1, H, len, D]: SDPA's fused CPU/GPU kernels take only 4-D inputs.
        qh, kh, vh = (x.transpose(0, 1)[None] for x in (q[start : start + n], keys, values))
        if p == 0:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        else:
            mask = torch.ones(n, p + n, dtype=torch.bool, device=q.device).tril(p)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        out[start : start + n] = o[0].transpose(0, 1)
        start, pre = start + n, pre + p
    return out
