"""MLA's expanded form (prefill, chunks, mixed batches) on the varlen extend
attention kernel.

The keys and values of the new tokens and of each sequence's cached prefix
have already been expanded from their latents (per head: keys qk_nope + rope
wide, values v_head_dim wide). The extend kernel takes one head_dim for keys
and values and reads a prefix from a paged [num_blocks, 2, page, heads, dim]
cache: so values are zero-padded to the key width (the padded output columns
are zeros and dropped, as transformers pads V for FlashAttention), and the
expanded prefixes are laid out in a scratch paged cache, each sequence's on
consecutive blocks. The padding costs (Dqk - Dv) / Dqk of the P @ V work
(1/3 at 192/128); prefill attention is a small part of a DeepSeek prefill,
whose MoE GEMMs dominate.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels.attention_checks import check_index
from kernels.extend_attention import extend_attention


@functools.lru_cache(maxsize=8)  # every layer of a step asks for the same layout
def scratch_layout(
    prefix_lens: tuple[int, ...], page: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The scratch cache's block table [B, max blocks] int32, the slot of every prefix
    token (sequence i's j-th at its block j // page, offset j % page), and the number
    of blocks (>= 1): each sequence's prefix on consecutive blocks."""
    counts = [-(-n // page) for n in prefix_lens]
    table = torch.zeros(len(counts), max(counts + [1]), dtype=torch.int32)
    slots, used = [], 0
    for i, (n, count) in enumerate(zip(prefix_lens, counts)):
        table[i, :count] = torch.arange(used, used + count, dtype=torch.int32)
        slots.append(torch.arange(n) + used * page)
        used += count
    slots = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
    return table.to(device), slots.to(device), max(used, 1)


def mla_extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    prefix_lens: list[int],
    max_query_len: int,
    scale: float,
    page: int = 16,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its expanded prefix and itself.

    q, k [T, H, Dqk], v [T, H, Dv] (Dv <= Dqk); k_prefix [P, H, Dqk], v_prefix [P, H, Dv]:
    the sequences' prefixes in order, prefix_lens[i] rows each (P = their sum);
    query_start_loc [B + 1], seq_lens [B] int32 (prefix + new). Returns [T, H, Dv]
    (see kernels.mla_reference.mla_extend).
    """
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"expected q, k [T, H, Dqk] and v [T, H, Dv], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")  # fmt: skip
    tokens, heads, qk_dim = q.shape
    v_dim = v.shape[2]
    if v_dim > qk_dim:
        raise ValueError(f"values ({v_dim}) may not be wider than keys ({qk_dim})")
    batch = len(prefix_lens)
    total = sum(prefix_lens)
    if any(n < 0 for n in prefix_lens):
        raise ValueError(f"prefix_lens must be non-negative, got {prefix_lens}")
    if k_prefix.shape != (total, heads, qk_dim) or v_prefix.shape != (total, heads, v_dim):
        raise ValueError(f"k_prefix / v_prefix must be [{total}, {heads}, {qk_dim} / {v_dim}], "
                         f"got {tuple(k_prefix.shape)}, {tuple(v_prefix.shape)}")  # fmt: skip
    check_index("seq_lens", seq_lens, q, (batch,))
    if page < 1:
        raise ValueError(f"page must be >= 1, got {page}")
    table, slots, num_blocks = scratch_layout(tuple(prefix_lens), page, q.device)
    scratch = torch.zeros(num_blocks, 2, page, heads, qk_dim, dtype=q.dtype, device=q.device)
    if total:
        blocks, offsets = slots // page, slots % page
        scratch[blocks, 0, offsets] = k_prefix.to(q.dtype)
        scratch[blocks, 1, offsets, :, :v_dim] = v_prefix.to(q.dtype)
    v_padded = F.pad(v, (0, qk_dim - v_dim))
    out = extend_attention(
        q, k.contiguous(), v_padded, scratch, table, query_start_loc, seq_lens, max_query_len,
        scale,
    )  # fmt: skip
    return out[..., :v_dim]
