"""Extend (prefill) attention with TMA loads of the new tokens' keys and values (Hopper+).

The same contract, grid and phases as the pointer kernel in kernels/extend_attention.py;
only how phases 2 and 3 read k and v differs. Both are [T, Hk, D] with the heads of a
row contiguous (a split of a fused qkv projection qualifies), so each is one 2-D tensor
[T, Hk * D] with row stride k.stride(0), described once on the host; a [BLOCK_N, D] box
at (row0 + start, kv_head * D) is one tile of keys or values. The TMA engine copies it
into shared memory where the tensor cores read it, so the loop keeps no pointer tensors
in registers, and the software pipeliner overlaps the copies with the math.

Varlen safety. A box is not bounded by its sequence: past the sequence's last token it
reads the next sequence's rows (zeros past T). Phase 2 only covers keys before the query
tile, all inside the sequence. On the diagonal the causal mask keeps, for each valid row
m < n_i, only keys <= m < n_i, so foreign keys get probability 0; but the tensor core
still multiplies their values by that 0, and 0 * NaN = NaN, so the one tile that
straddles n_i (the last, when n_i is not a multiple of BLOCK_N) zeroes its foreign value
rows. Rows m >= n_i are never stored: the output keeps masked pointer stores.

The cached prefix (phase 1) stays a paged pointer gather, in tiles of at most 32 keys:
full-width gathers spill registers on sm_90, even though a prompt without a prefix never
runs them. Softmax as in Triton's fused-attention tutorial: the row max is taken on raw
scores and scaled once per row, so each score costs one FMA (s * scale - max) before
exp2, and P @ V accumulates into the rescaled accumulator inside the dot. With PIPELINE,
phase 2 issues each tile's q k^T one tile ahead, so the tensor cores compute the next
scores while the same warps run this tile's softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.3: host-side tensor descriptors
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None

from kernels.attention_checks import dot_precision, extend_tiles

LOG2E = 1.4426950408889634


@triton.jit
def _attend_scores(s, v, m_i, l_i, acc, qk_scale, keep, MASKED: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):  # fmt: skip
    """One online-softmax step (base 2) over the scores s = q k^T of a [BLOCK_N] tile of
    keys, and its values.

    m_i is kept in scaled units; qk_scale > 0, so max(s) * scale == max(s * scale)."""
    if MASKED:
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, acc


@triton.jit
def _attend_tile(q, k, v, m_i, l_i, acc, qk_scale, keep, MASKED: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):  # fmt: skip
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    return _attend_scores(s, v, m_i, l_i, acc, qk_scale, keep, MASKED, DOT_PRECISION)


@triton.jit
def _extend_tma_kernel(
    q_ptr, k_desc, v_desc, cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    out_ptr, qk_scale,  # softmax scale * log2(e), > 0
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
    GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PREFIX_N: tl.constexpr, DOT_PRECISION: tl.constexpr, PIPELINE: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)  # longest causal tiles first
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    num_new = tl.load(query_start_loc_ptr + seq + 1) - q_start
    m0 = tile * BLOCK_M
    if m0 >= num_new:
        return
    prefix = tl.load(seq_lens_ptr + seq) - num_new
    kv_head = head // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)  # the host only launches power-of-2 head dims
    m_ok = offs_m < num_new
    row0 = q_start.to(tl.int64)
    q_ptrs = q_ptr + row0 * stride_qt + head * stride_qh
    q = tl.load(q_ptrs + offs_m[:, None] * stride_qt + offs_d[None, :], mask=m_ok[:, None],
                other=0.0)  # fmt: skip

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # 1. The cached prefix, gathered page by page in PREFIX_N-key tiles (narrower than
    # BLOCK_N: pointer gathers hold their tiles and addresses in registers, and full-width
    # ones spill at 128 x 64 and 128 x 128 on sm_90): whole tiles, then a masked tail.
    offs_p = tl.arange(0, PREFIX_N)
    stride_slot: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    stride_kv: tl.constexpr = PAGE_SIZE * stride_slot
    stride_block: tl.constexpr = 2 * stride_kv
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
    cache_head_ptr = cache_ptr + kv_head * HEAD_DIM
    prefix_whole = prefix // PREFIX_N * PREFIX_N
    for start in range(0, prefix_whole, PREFIX_N):
        tokens = start + offs_p
        block_ids = tl.load(table_ptr + tokens // PAGE_SIZE)
        slots = block_ids.to(tl.int64) * stride_block + (tokens % PAGE_SIZE) * stride_slot
        kv_ptrs = cache_head_ptr + slots[:, None] + offs_d[None, :]
        k = tl.load(kv_ptrs)
        v = tl.load(kv_ptrs + stride_kv)
        m_i, l_i, acc = _attend_tile(q, k, v, m_i, l_i, acc, qk_scale, offs_p, False,
                                     DOT_PRECISION)  # fmt: skip
    if prefix_whole < prefix:
        tokens = prefix_whole + offs_p
        n_ok = tokens < prefix
        block_ids = tl.load(table_ptr + tokens // PAGE_SIZE, mask=n_ok, other=0)
        slots = block_ids.to(tl.int64) * stride_block + (tokens % PAGE_SIZE) * stride_slot
        kv_ptrs = cache_head_ptr + slots[:, None] + offs_d[None, :]
        k = tl.load(kv_ptrs, mask=n_ok[:, None], other=0.0)
        v = tl.load(kv_ptrs + stride_kv, mask=n_ok[:, None], other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, m_i, l_i, acc, qk_scale, n_ok[None, :], True,
                                     DOT_PRECISION)  # fmt: skip

    # 2. New tokens before this query tile (all inside the sequence): TMA tiles, no mask.
    # PIPELINE issues the next tile's q k^T before this tile's softmax, so the tensor
    # cores run it while the same warps compute exp2 (the scores ride one tile ahead, in
    # registers); the tile after the last one is the first diagonal tile (key
    # diagonal_start <= m0 < num_new, inside the sequence), finished here under its mask.
    col = kv_head * HEAD_DIM
    diagonal_start = m0 // BLOCK_N * BLOCK_N
    rest_start = diagonal_start
    if PIPELINE:
        k = k_desc.load([q_start, col])
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        for start in range(0, diagonal_start, BLOCK_N):
            k_next = k_desc.load([q_start + start + BLOCK_N, col])
            v = v_desc.load([q_start + start, col])
            s_next = tl.dot(q, tl.trans(k_next), input_precision=DOT_PRECISION)
            m_i, l_i, acc = _attend_scores(s, v, m_i, l_i, acc, qk_scale, offs_n, False,
                                           DOT_PRECISION)  # fmt: skip
            s = s_next
        tokens = diagonal_start + offs_n
        v = v_desc.load([q_start + diagonal_start, col])
        v = tl.where((tokens < num_new)[:, None], v, 0.0)  # see the straddling tile below
        causal = tokens[None, :] <= offs_m[:, None]
        m_i, l_i, acc = _attend_scores(s, v, m_i, l_i, acc, qk_scale, causal, True,
                                       DOT_PRECISION)  # fmt: skip
        rest_start += BLOCK_N
    else:
        for start in range(0, diagonal_start, BLOCK_N):
            k = k_desc.load([q_start + start, col])
            v = v_desc.load([q_start + start, col])
            m_i, l_i, acc = _attend_tile(q, k, v, m_i, l_i, acc, qk_scale, offs_n, False,
                                         DOT_PRECISION)  # fmt: skip

    # 3. The diagonal, causal mask: tiles wholly inside the sequence, then the one that
    # straddles its end. The first diagonal tile holds key diagonal_start <= every row,
    # so no valid row meets an all-masked tile before it has a finite running max.
    diagonal_end = tl.minimum(m0 + BLOCK_M, num_new)
    whole_end = diagonal_start + (diagonal_end - diagonal_start) // BLOCK_N * BLOCK_N
    for start in range(rest_start, whole_end, BLOCK_N):
        k = k_desc.load([q_start + start, col])
        v = v_desc.load([q_start + start, col])
        causal = (start + offs_n)[None, :] <= offs_m[:, None]
        m_i, l_i, acc = _attend_tile(q, k, v, m_i, l_i, acc, qk_scale, causal, True,
                                     DOT_PRECISION)  # fmt: skip
    if (whole_end < diagonal_end) & (whole_end >= rest_start):
        tokens = whole_end + offs_n
        k = k_desc.load([q_start + whole_end, col])
        v = v_desc.load([q_start + whole_end, col])
        # Rows past num_new belong to the next sequence (or are padding): their keys are
        # masked below for every stored row, their values zeroed so 0 * NaN cannot leak.
        v = tl.where((tokens < num_new)[:, None], v, 0.0)
        causal = tokens[None, :] <= offs_m[:, None]
        m_i, l_i, acc = _attend_tile(q, k, v, m_i, l_i, acc, qk_scale, causal, True,
                                     DOT_PRECISION)  # fmt: skip

    o_ptrs = out_ptr + row0 * stride_ot + head * stride_oh
    o_ptrs += offs_m[:, None] * stride_ot + offs_d[None, :]
    result = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(o_ptrs, result, mask=m_ok[:, None])


def tma_device_ok(device: torch.device) -> bool:
    """Whether this device and Triton build can run the TMA kernel (sm_90 or newer)."""
    if TensorDescriptor is None or not hasattr(tl, "make_tensor_descriptor"):
        return False
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def _2d_ok(x: torch.Tensor, head_dim: int) -> bool:
    """x [T, H, D] is one 2-D [T, H * D] TMA tensor: rows 16-byte aligned, heads packed."""
    size = x.element_size()
    return (
        x.shape[0] > 0
        and x.stride(2) == 1
        and (x.shape[1] == 1 or x.stride(1) == head_dim)
        and x.stride(0) >= x.shape[1] * head_dim
        and (x.stride(0) * size) % 16 == 0
        and x.data_ptr() % 16 == 0
    )


def tma_inputs_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> bool:
    """Whether these (already checked) inputs suit the TMA kernel; else use the pointer one."""
    head_dim = q.shape[2]
    return (
        TensorDescriptor is not None
        and 16 <= head_dim <= 256
        and head_dim & (head_dim - 1) == 0  # a box as wide as one head, no padding columns
        and (head_dim * q.element_size()) % 16 == 0
        and scale > 0
        and _2d_ok(k, head_dim)
        and _2d_ok(v, head_dim)
    )


def _descriptor(x: torch.Tensor, block_n: int) -> TensorDescriptor:
    tokens, heads, head_dim = x.shape
    return TensorDescriptor(x, [tokens, heads * head_dim], [x.stride(0), 1], [block_n, head_dim])


def flash_extend_tma(
    q, k, v, cache, block_tables, query_start_loc, seq_lens, max_query_len, scale, out,
    *, block_m, block_n, num_warps, num_stages, pipeline=False,
):  # fmt: skip
    """One launch with an explicit config; inputs checked, and tma_inputs_ok(q, k, v, scale).
    pipeline: issue each tile's q k^T one tile ahead (see phase 2 of the kernel)."""
    q_heads, head_dim = q.shape[1], q.shape[2]
    page_size, kv_heads = cache.shape[2], cache.shape[3]
    grid, block_m, block_n, num_stages = extend_tiles(
        q, seq_lens, max_query_len, block_m, block_n, num_stages
    )
    _extend_tma_kernel[grid](
        q, _descriptor(k, block_n), _descriptor(v, block_n), cache, block_tables,
        query_start_loc, seq_lens, out, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=q_heads // kv_heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n, PREFIX_N=min(block_n, 32),
        DOT_PRECISION=dot_precision(q.dtype), PIPELINE=pipeline,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


# Hopper shapes for head_dim 128, none spilling registers on sm_90. 4 warps = one
# warpgroup on 64 query rows; at 64 x 64 with 3 stages two CTAs share an SM, whose
# barriers do not couple (one's softmax overlaps the other's matrix products); on an H200
# it and 128 x 64 with 8 warps are the fastest for long causal prompts. Deeper pipelines
# and wider key tiles (64 x 128) trade that second CTA for fewer, longer TMA copies.
# 8 warps = two warpgroups of 64 query rows sharing each K/V tile; TMA frees the
# registers pointer loads held, so 128 x 128 tiles fit too. Pipelined scores keep two
# tiles of scores live: at 64 x 64 with 4 warps ptxas then serializes the wgmma
# instructions (too few registers), so they run at 64 x 32 with 4 warps (146 registers),
# where they beat the same tiles unpipelined (1.36 against 1.42 ms at 8k tokens on an
# H200). With 8 warps, pipelined 128 x 64 ran correctly in bf16 but no faster than
# unpipelined, and faulted (illegal address) at its float32 fit, 64 x 32 with 8 warps:
# not a candidate, since a fault ends the process that tunes. `python -m
# kernels.compile_report` prints every candidate's registers, spills and shared memory.
TMA_CONFIGS = [
    dict(block_m=64, block_n=64, num_warps=4, num_stages=3),
    dict(block_m=64, block_n=128, num_warps=4, num_stages=3),
    dict(block_m=128, block_n=64, num_warps=8, num_stages=4),
    dict(block_m=128, block_n=64, num_warps=8, num_stages=3),
    dict(block_m=128, block_n=128, num_warps=8, num_stages=2),
    dict(block_m=64, block_n=32, num_warps=4, num_stages=4, pipeline=True),
]
