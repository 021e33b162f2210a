"""Pure-torch paged attention: what the Triton attention kernels must compute.

One call covers a whole batch of sequences laid out flat: sequence i owns
query rows query_start[i]:query_start[i+1] (its newest tokens) and attends,
causally, over its first seq_lens[i] cached tokens, which live in the blocks
listed in block_tables[i]. A decode is a sequence with one query row; a
prefill chunk after a prefix hit has fewer query rows than cached tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int):
    """The first `length` keys and values of one sequence: ([length, H, D], [length, H, D])."""
    block_size = cache.shape[2]
    num_blocks = -(-length // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    k = blocks[:, 0].reshape(-1, *cache.shape[3:])[:length]
    v = blocks[:, 1].reshape(-1, *cache.shape[3:])[:length]
    return k, v


def paged_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D]; cache: [num_blocks, 2, block_size, Hk, D]. Returns [T, Hq, D]."""
    if all(n == 1 for n in query_lens):
        return _decode(q, cache, block_tables, seq_lens, scale)
    out = torch.empty_like(q)
    start = 0
    for i, (n, length) in enumerate(zip(query_lens, seq_lens)):
        k, v = gather_kv(cache, block_tables[i], length)
        out[start : start + n] = _attend(q[start : start + n], k, v, length - n, scale)
        start += n
    return out


def _attend(q, k, v, prefix: int, scale: float) -> torch.Tensor:
    """Causal attention of n queries at positions prefix..prefix+n-1 over keys 0..prefix+n-1."""
    n, length = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    # [1, H, n, D]: SDPA's fused backends take only 4-D inputs; with 3-D ones torch falls
    # back to its math backend, which rounds 16-bit scores before the softmax.
    qh = q.transpose(0, 1)[None]
    kh = k.transpose(0, 1).repeat_interleave(groups, dim=0)[None]
    vh = v.transpose(0, 1).repeat_interleave(groups, dim=0)[None]
    if prefix == 0:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(prefix)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return o[0].transpose(0, 1)


def _decode(q, cache, block_tables, seq_lens: list[int], scale: float) -> torch.Tensor:
    """All sequences have one query: gather every context into one padded batch."""
    batch = q.shape[0]
    block_size, kv_heads, head_dim = cache.shape[2], cache.shape[3], cache.shape[4]
    max_len = max(seq_lens)
    num_blocks = -(-max_len // block_size)
    table = block_tables[:, :num_blocks].long()
    kv = cache[table]  # [B, nblk, 2, bs, Hk, D]
    k = kv[:, :, 0].reshape(batch, -1, kv_heads, head_dim)
    v = kv[:, :, 1].reshape(batch, -1, kv_heads, head_dim)
    lens = torch.tensor(seq_lens, device=q.device)
    positions = torch.arange(k.shape[1], device=q.device)
    mask = (positions[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    groups = q.shape[1] // kv_heads
    qh = q.unsqueeze(2)  # [B, Hq, 1, D]
    kh = k.transpose(1, 2).repeat_interleave(groups, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(groups, dim=1)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return o.squeeze(2)
