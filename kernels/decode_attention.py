"""Paged decode attention in Triton: split-KV flash-decoding.

Every sequence has one new query token (already written to the cache at
position seq_lens - 1). Stage 1 runs one program per (sequence, kv head,
split): it loads the G query heads that share the kv head as one [G, D] tile,
so each key and value is read from memory once per group, and walks its slice
of the context in tiles of BLOCK_N tokens gathered through block_tables. It
writes a float32 partial output and log-sum-exp per (sequence, head, split);
stage 2 merges the splits. With one split, stage 1 writes the output itself.

Split sizes come from each sequence's own length on the device, so the host
needs no lengths beyond `max_seq_len` (which only sets the number of splits)
and the launch can be captured in a CUDA graph and replayed at longer lengths.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.attention_checks import check_common, check_out, dot_precision, fit_float32
from kernels.selection import Selector, next_power_of_2

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_table,
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Whole tiles per split, so only a split's last tile is partial.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if NUM_SPLITS > 1:
        if start >= end:  # past this sequence's end: stage 2 skips this split
            return

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q_ptrs = q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    # The cache is contiguous [num_blocks, 2, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM].
    stride_slot: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    stride_kv: tl.constexpr = PAGE_SIZE * stride_slot
    stride_block: tl.constexpr = 2 * stride_kv
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
    head_ptr = cache_ptr + kv_head * HEAD_DIM

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + offs_n
        n_mask = tokens < end
        block_ids = tl.load(table_ptr + tokens // PAGE_SIZE, mask=n_mask, other=0)
        # int64: a large cache has more than 2**31 elements.
        token_offs = block_ids.to(tl.int64) * stride_block + (tokens % PAGE_SIZE) * stride_slot
        kv_ptrs = head_ptr + token_offs[:, None] + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(kv_ptrs, mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(kv_ptrs + stride_kv, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        # An empty sequence (padding) gets zeros rather than 0/0.
        result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        row = (seq * (GROUP * NUM_KV_HEADS) + heads) * NUM_SPLITS + split
        tl.store(
            part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
            acc / l_i[:, None],
            mask=out_mask,
        )
        tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    # The same split sizing as stage 1: splits past the end were never written.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    num_valid = tl.cdiv(seq_len, tl.maximum(split_len, 1))
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_valid
    d_mask = offs_d < HEAD_DIM
    row = (seq * NUM_Q_HEADS + head) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    parts = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    lse_max = tl.where(num_valid > 0, tl.max(lse, 0), 0.0)  # no -inf - -inf for padding
    weights = tl.where(s_mask, tl.exp2(lse - lse_max), 0.0)
    total = tl.sum(weights, 0)
    result = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    o_ptrs = out_ptr + seq * stride_ob + head * stride_oh + offs_d
    tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H200, so CPU runs exercise the same split choices


def choose_num_splits(
    batch: int, kv_heads: int, max_seq_len: int, block_n: int, programs_per_sm: int, sms: int
) -> int:
    """Splits so stage 1 has about programs_per_sm programs per SM, each with >= 4 tiles."""
    wanted = triton.cdiv(programs_per_sm * sms, max(batch * kv_heads, 1))
    splits = min(wanted, max_seq_len // (4 * block_n), 64)
    # Rounded down to a power of two: few compiled variants, and neither cap is exceeded.
    return 1 << (splits.bit_length() - 1) if splits > 1 else 1


def split_partials(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1's per-split outputs [B, H, S, D] and log2-sum-exps [B, H, S] (float32) for
    out [B, H, D]; unsplit, stage 1 writes `out` itself and these are unused."""
    if num_splits == 1:
        return out, out
    batch, heads, dim = out.shape
    part_out = torch.empty(batch, heads, num_splits, dim, dtype=torch.float32, device=out.device)
    part_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=out.device)
    return part_out, part_lse


def reduce_splits(part_out, part_lse, seq_lens, out, num_splits: int, block_n: int, block_d: int):
    """Stage 2: each (sequence, head)'s splits merged into out [B, H, D] (nothing unsplit)."""
    if num_splits == 1:
        return
    batch, heads, dim = out.shape
    _decode_reduce_kernel[(batch, heads)](
        part_out, part_lse, seq_lens, out, out.stride(0), out.stride(1),
        NUM_Q_HEADS=heads, HEAD_DIM=dim, NUM_SPLITS=num_splits, BLOCK_N=block_n,
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        num_warps=4 if block_d * num_splits >= 2048 else 1,
    )  # fmt: skip


def split_kv_decode(
    q, cache, block_tables, seq_lens, scale, max_seq_len, out,
    *, block_n, num_warps, num_stages, programs_per_sm, num_splits=None,
):  # fmt: skip
    """One launch with an explicit config (what the Selector times); inputs already checked.

    num_splits overrides the policy (tests use it to check splits do not change the result).
    """
    batch, q_heads, head_dim = q.shape
    page_size, kv_heads = cache.shape[2], cache.shape[3]
    block_n, num_stages = fit_float32(q.dtype, block_n, num_stages)
    if num_splits is None:
        sms = _sm_count(q.device)
        num_splits = choose_num_splits(batch, kv_heads, max_seq_len, block_n, programs_per_sm, sms)
    group = q_heads // kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    part_out, part_lse = split_partials(out, num_splits)
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, cache, block_tables, seq_lens, out, part_out, part_lse,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        NUM_SPLITS=num_splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot needs M >= 16
        BLOCK_D=block_d, BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    reduce_splits(part_out, part_lse, seq_lens, out, num_splits, block_n, block_d)
    return out


# The first config is the CPU default and a sound GPU one; the rest are tried on CUDA.
DECODE_CONFIGS = [
    dict(block_n=64, num_warps=4, num_stages=2, programs_per_sm=4),
    dict(block_n=64, num_warps=4, num_stages=3, programs_per_sm=4),
    dict(block_n=64, num_warps=4, num_stages=2, programs_per_sm=8),
    dict(block_n=128, num_warps=4, num_stages=2, programs_per_sm=4),
    dict(block_n=128, num_warps=8, num_stages=2, programs_per_sm=4),
    dict(block_n=32, num_warps=4, num_stages=4, programs_per_sm=8),
    dict(block_n=64, num_warps=4, num_stages=2, programs_per_sm=2),
    dict(block_n=128, num_warps=4, num_stages=3, programs_per_sm=8),
]


def _bucket(q, cache, block_tables, seq_lens, scale, max_seq_len, out):
    return (
        next_power_of_2(q.shape[0]),
        next_power_of_2(max_seq_len),
        q.shape[1],
        cache.shape[3],
        q.shape[2],
        str(q.dtype),
        cache.shape[2],
    )


_SELECTOR = Selector(
    "decode_attention", {"split_kv": split_kv_decode}, {"split_kv": DECODE_CONFIGS}, _bucket
)


def decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new query per sequence over its paged context.

    q: [B, Hq, D]; cache: [num_blocks, 2, block_size, Hk, D] contiguous; block_tables:
    [B, max_blocks] int32; seq_lens: [B] int32 (including the new token; a padding
    row of 0 gives zeros);
    max_seq_len: an upper bound of seq_lens known on the host (sets the split count only).
    Returns out: [B, Hq, D] in q's dtype.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, q_heads, head_dim], got shape {tuple(q.shape)}")
    batch = q.shape[0]
    check_common(q, cache, block_tables, seq_lens, batch, _decode_split_kernel)
    if not isinstance(max_seq_len, int) or max_seq_len < 0:
        raise ValueError(f"max_seq_len must be a non-negative Python int, got {max_seq_len!r}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    check_out(q, out)
    if batch == 0:
        return out
    return _SELECTOR(q, cache, block_tables, seq_lens, scale, max_seq_len, out)
