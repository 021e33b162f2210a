"""Paged extend (prefill) attention in Triton for a variable-length batch.

Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1] (its n_i new
tokens) and has seq_lens[i] tokens in all. Its first seq_lens[i] - n_i tokens
(a cached prefix, or none) are gathered from the paged cache through
block_tables; its new tokens' keys and values come from the contiguous k, v
with a causal mask. One kernel covers plain prefill, chunked prefill,
prefix-cache hits and decode rows in a mixed batch.

Grid: (q head, query tile, sequence). Query tiles are launched last-first so
the longest causal tiles start early, and the G heads sharing a kv head are
neighbours in launch order so their K/V tiles are shared through L2. Tiles
past a sequence's n_i exit at once: the host passes only max_query_len.

Variants the Selector tunes between, each candidate's output checked against
the first candidate's (this file's kernel with its first config): "flash", this
file's kernel, pointer loads everywhere, runs anywhere (the CPU default); "tma"
(kernels/extend_attention_tma.py), the same phases with the new tokens' K/V read
by TMA, on sm_90+.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_checks import (
    check_common,
    check_heads,
    check_index,
    check_out,
    dot_precision,
    extend_tiles,
)
from kernels.extend_attention_tma import (
    TMA_CONFIGS,
    flash_extend_tma,
    tma_device_ok,
    tma_inputs_ok,
)
from kernels.selection import Selector, next_power_of_2
from kernels.selection_verify import ATTENTION_TOLERANCE, close_outputs

LOG2E = 1.4426950408889634


@triton.jit
def _load_tile(ptrs, rows_ok, cols_ok, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    # Unmasked loads where the shape allows: they vectorise and skip predicate math.
    if CHECK_ROWS and CHECK_COLS:
        tile = tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
    elif CHECK_ROWS:
        tile = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    elif CHECK_COLS:
        tile = tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _softmax_step(q, k, v, m_i, l_i, acc, qk_scale, keep, MASKED: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):  # fmt: skip
    """One online-softmax step (base 2) over a [BLOCK_N] tile of keys and values."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_table,
    GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    num_new = tl.load(query_start_loc_ptr + seq + 1) - q_start
    m0 = tile * BLOCK_M
    if m0 >= num_new:
        return
    prefix = tl.load(seq_lens_ptr + seq) - num_new
    kv_head = head // GROUP
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < num_new
    d_ok = offs_d < HEAD_DIM
    row0 = q_start.to(tl.int64)  # int64 row base; in-tile offsets stay int32
    q_ptrs = q_ptr + row0 * stride_qt + head * stride_qh
    q_ptrs += offs_m[:, None] * stride_qt + offs_d[None, :]
    q = _load_tile(q_ptrs, m_ok, d_ok, True, not EVEN_D)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # 1. The cached prefix, gathered page by page: whole tiles, then a masked tail.
    stride_slot: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    stride_kv: tl.constexpr = PAGE_SIZE * stride_slot
    stride_block: tl.constexpr = 2 * stride_kv
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
    cache_head_ptr = cache_ptr + kv_head * HEAD_DIM
    prefix_whole = prefix // BLOCK_N * BLOCK_N
    for start in range(0, prefix_whole, BLOCK_N):
        tokens = start + offs_n
        block_ids = tl.load(table_ptr + tokens // PAGE_SIZE)
        slots = block_ids.to(tl.int64) * stride_block + (tokens % PAGE_SIZE) * stride_slot
        kv_ptrs = cache_head_ptr + slots[:, None] + offs_d[None, :]
        k = _load_tile(kv_ptrs, offs_n, d_ok, False, not EVEN_D)
        v = _load_tile(kv_ptrs + stride_kv, offs_n, d_ok, False, not EVEN_D)
        m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, qk_scale, offs_n, False,
                                      DOT_PRECISION)  # fmt: skip
    if prefix_whole < prefix:
        tokens = prefix_whole + offs_n
        n_ok = tokens < prefix
        block_ids = tl.load(table_ptr + tokens // PAGE_SIZE, mask=n_ok, other=0)
        slots = block_ids.to(tl.int64) * stride_block + (tokens % PAGE_SIZE) * stride_slot
        kv_ptrs = cache_head_ptr + slots[:, None] + offs_d[None, :]
        k = _load_tile(kv_ptrs, n_ok, d_ok, True, not EVEN_D)
        v = _load_tile(kv_ptrs + stride_kv, n_ok, d_ok, True, not EVEN_D)
        m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, qk_scale, n_ok[None, :], True,
                                      DOT_PRECISION)  # fmt: skip

    # 2. New tokens before this query tile: every row sees every key, no mask.
    k_base = k_ptr + row0 * stride_kt + kv_head * stride_kh
    v_base = v_ptr + row0 * stride_vt + kv_head * stride_vh
    diagonal_start = m0 // BLOCK_N * BLOCK_N
    for start in range(0, diagonal_start, BLOCK_N):
        tokens = start + offs_n
        k = _load_tile(k_base + tokens[:, None] * stride_kt + offs_d[None, :], tokens, d_ok,
                       False, not EVEN_D)  # fmt: skip
        v = _load_tile(v_base + tokens[:, None] * stride_vt + offs_d[None, :], tokens, d_ok,
                       False, not EVEN_D)  # fmt: skip
        m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, qk_scale, offs_n, False,
                                      DOT_PRECISION)  # fmt: skip

    # 3. The diagonal: causal mask. Its first tile holds key m0 // BLOCK_N * BLOCK_N <= every
    # row, so no row meets an all-masked tile before it has a finite running max.
    diagonal_end = tl.minimum(m0 + BLOCK_M, num_new)
    for start in range(diagonal_start, diagonal_end, BLOCK_N):
        tokens = start + offs_n
        n_ok = tokens < num_new
        k = _load_tile(k_base + tokens[:, None] * stride_kt + offs_d[None, :], n_ok, d_ok,
                       True, not EVEN_D)  # fmt: skip
        v = _load_tile(v_base + tokens[:, None] * stride_vt + offs_d[None, :], n_ok, d_ok,
                       True, not EVEN_D)  # fmt: skip
        causal = tokens[None, :] <= offs_m[:, None]
        m_i, l_i, acc = _softmax_step(q, k, v, m_i, l_i, acc, qk_scale, causal, True,
                                      DOT_PRECISION)  # fmt: skip

    o_ptrs = out_ptr + row0 * stride_ot + head * stride_oh
    o_ptrs += offs_m[:, None] * stride_ot + offs_d[None, :]
    result = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
    if EVEN_D:
        tl.store(o_ptrs, result, mask=m_ok[:, None])
    else:
        tl.store(o_ptrs, result, mask=m_ok[:, None] & d_ok[None, :])


def flash_extend(
    q, k, v, cache, block_tables, query_start_loc, seq_lens, max_query_len, scale, out,
    *, block_m, block_n, num_warps, num_stages,
):  # fmt: skip
    """One launch with an explicit config (what the Selector times); inputs already checked."""
    q_heads, head_dim = q.shape[1], q.shape[2]
    page_size, kv_heads = cache.shape[2], cache.shape[3]
    grid, block_m, block_n, num_stages = extend_tiles(
        q, seq_lens, max_query_len, block_m, block_n, num_stages
    )
    _extend_kernel[grid](
        q, k, v, cache, block_tables, query_start_loc, seq_lens, out,
        scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=q_heads // kv_heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),  # tl.dot needs K >= 16
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


# The first config is the CPU default and the usual Hopper choice for head_dim 128; all
# of these compile without register spills at head_dim 128 on sm_90 (128 x 128 tiles
# with 8 warps, or 128-row tiles with 4 warps and BLOCK_N 64, spill). The 16-row one
# is for batches of short chunks and decode rows.
EXTEND_CONFIGS = [
    dict(block_m=128, block_n=64, num_warps=8, num_stages=3),
    dict(block_m=128, block_n=64, num_warps=8, num_stages=2),
    dict(block_m=128, block_n=64, num_warps=8, num_stages=4),
    dict(block_m=128, block_n=32, num_warps=4, num_stages=3),
    dict(block_m=64, block_n=64, num_warps=4, num_stages=3),
    dict(block_m=64, block_n=32, num_warps=4, num_stages=4),
    dict(block_m=16, block_n=32, num_warps=4, num_stages=2),
]


def _bucket(q, k, v, cache, block_tables, query_start_loc, seq_lens, max_query_len, scale, out):
    return (
        next_power_of_2(seq_lens.shape[0]),
        next_power_of_2(max_query_len),
        q.shape[1],
        cache.shape[3],
        q.shape[2],
        str(q.dtype),
        cache.shape[2],
    )


def tma_extend(q, k, v, cache, block_tables, query_start_loc, seq_lens, max_query_len, scale,
               out, **config):  # fmt: skip
    """The TMA kernel where the inputs suit it (aligned rows, heads packed, a power-of-2
    head_dim), else the pointer kernel with the same config: a bucket's choice holds for
    every input in it."""
    args = (q, k, v, cache, block_tables, query_start_loc, seq_lens, max_query_len, scale, out)
    if tma_inputs_ok(q, k, v, scale):
        return flash_extend_tma(*args, **config)
    config.pop("pipeline", None)  # a TMA-only option
    return flash_extend(*args, **config)


SELECTOR = Selector(
    "extend_attention",
    {"flash": flash_extend, "tma": tma_extend},
    {"flash": EXTEND_CONFIGS, "tma": TMA_CONFIGS},
    _bucket,
    supported={"tma": tma_device_ok},
    verify=close_outputs(ATTENTION_TOLERANCE),
    revision="tma-pipeline",  # choices made before these candidates existed are made again
)


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix and themselves.

    q: [T, Hq, D]; k, v: [T, Hk, D] (the new tokens' keys and values, also in the cache);
    cache: [num_blocks, 2, block_size, Hk, D] contiguous; block_tables: [B, max_blocks]
    int32; query_start_loc: [B + 1] int32; seq_lens: [B] int32 (prefix + new tokens);
    max_query_len: a host-side upper bound of the new tokens per sequence.
    Returns out: [T, Hq, D] in q's dtype.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, q_heads, head_dim], got shape {tuple(q.shape)}")
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens must be [batch], got shape {tuple(seq_lens.shape)}")
    batch = seq_lens.shape[0]
    check_common(q, cache, block_tables, seq_lens, batch, _extend_kernel)
    kv_heads = cache.shape[3]
    for name, x in (("k", k), ("v", v)):
        check_heads(name, x, q, kv_heads)
        if x.shape[0] != q.shape[0]:
            raise ValueError(f"{name} must have q's {q.shape[0]} tokens, got {x.shape[0]}")
    check_index("query_start_loc", query_start_loc, q, (batch + 1,))
    if not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be a non-negative Python int, got {max_query_len!r}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    check_out(q, out)
    if batch == 0 or max_query_len == 0 or q.shape[0] == 0:
        return out
    return SELECTOR(
        q, k, v, cache, block_tables, query_start_loc, seq_lens, max_query_len, scale, out
    )
