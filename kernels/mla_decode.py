"""Paged MLA decode in Triton: the absorbed form, split-KV.

Every sequence has one new query token whose heads all attend over the same
latent "head": cache entries [latent (C) | k_pe (R)], C + R = 576 at V2/V3
widths. Score = q_latent . latent + q_pe . k_pe; output = sum p * latent. So
one tile of entries, loaded once, is both the keys and the values of every
query head of the program: the kernel reads the cache once per head block.

Stage 1 runs one program per (head block, split, sequence): BLOCK_H query
heads as the rows of its tl.dot, its slice of the context in tiles of BLOCK_N
tokens gathered through block_tables, partial outputs and log-sum-exps in
float32. Head blocks of one split are neighbours in launch order, so when a
model has more heads than one block (V3: 128) the blocks of a tile share it
through L2. Stage 2 is the GQA decode kernel's merge (one query row per
(sequence, head), HEAD_DIM = C). With one split, stage 1 writes the output.

Split sizes come from each sequence's own length on the device, so a launch
can be captured in a CUDA graph and replayed at other lengths; `max_seq_len`
only sets the number of splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_checks import SUPPORTED_DTYPES, check_device, check_index, dot_precision
from kernels.decode_attention import (
    LOG2E,
    _sm_count,
    choose_num_splits,
    reduce_splits,
    split_partials,
)
from kernels.selection import Selector, next_power_of_2
from kernels.selection_verify import ATTENTION_TOLERANCE, close_outputs


@triton.jit
def _mla_decode_split_kernel(
    q_ptr, q_pe_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr,
    part_lse_ptr,
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    stride_qb, stride_qh, stride_pb, stride_ph, stride_ob, stride_oh, stride_table,
    NUM_HEADS: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr,
    PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    head_block = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Whole tiles per split (the reduce stage sizes splits the same way).
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if NUM_SPLITS > 1:
        if start >= end:  # past this sequence's end: stage 2 skips this split
            return

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = heads < NUM_HEADS
    c_ok = offs_c < LATENT
    r_ok = offs_r < ROPE
    q_c = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_c[None, :],
                  mask=h_ok[:, None] & c_ok[None, :], other=0.0)  # fmt: skip
    q_r = tl.load(q_pe_ptr + seq * stride_pb + heads[:, None] * stride_ph + offs_r[None, :],
                  mask=h_ok[:, None] & r_ok[None, :], other=0.0)  # fmt: skip

    # The cache is contiguous [num_blocks, 1, PAGE_SIZE, 1, LATENT + ROPE].
    ENTRY: tl.constexpr = LATENT + ROPE
    STRIDE_BLOCK: tl.constexpr = PAGE_SIZE * ENTRY
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + offs_n
        n_ok = tokens < end
        block_ids = tl.load(table_ptr + tokens // PAGE_SIZE, mask=n_ok, other=0)
        # int64: a large cache has more than 2**31 elements.
        entries = block_ids.to(tl.int64) * STRIDE_BLOCK + (tokens % PAGE_SIZE) * ENTRY
        latent = tl.load(cache_ptr + entries[:, None] + offs_c[None, :],
                         mask=n_ok[:, None] & c_ok[None, :], other=0.0)  # fmt: skip
        k_pe = tl.load(cache_ptr + entries[:, None] + LATENT + offs_r[None, :],
                       mask=n_ok[:, None] & r_ok[None, :], other=0.0)  # fmt: skip
        qk = tl.dot(q_c, tl.trans(latent), input_precision=DOT_PRECISION)
        qk = tl.dot(q_r, tl.trans(k_pe), qk, input_precision=DOT_PRECISION)
        qk = tl.where(n_ok[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        # The same latent tile is the values: no second read.
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent,
                                            input_precision=DOT_PRECISION)  # fmt: skip
        m_i = m_new

    out_mask = h_ok[:, None] & c_ok[None, :]
    if NUM_SPLITS == 1:
        result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a padding row (length 0): zeros
        o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_c[None, :]
        tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        row = (seq * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * LATENT + offs_c[None, :], acc / l_i[:, None],
                 mask=out_mask)  # fmt: skip
        tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=h_ok)


def split_kv_mla_decode(
    q_latent, q_pe, cache, block_tables, seq_lens, scale, max_seq_len, out,
    *, block_h, block_n, num_warps, num_stages, programs_per_sm, num_splits=None,
):  # fmt: skip
    """One launch with an explicit config (what the Selector times); inputs already checked.

    num_splits overrides the policy (tests use it to check splits do not change the result).
    """
    batch, heads, latent_dim = q_latent.shape
    rope_dim, page_size = q_pe.shape[2], cache.shape[2]
    if q_latent.dtype == torch.float32:  # 4-byte tiles of 512 columns: keep shared memory in bounds
        block_n, num_stages = min(block_n, 32), min(num_stages, 2)
    block_h = max(16, min(block_h, next_power_of_2(heads)))  # tl.dot needs M >= 16
    head_blocks = triton.cdiv(heads, block_h)
    if num_splits is None:
        num_splits = choose_num_splits(batch, head_blocks, max_seq_len, block_n, programs_per_sm,
                                       _sm_count(q_latent.device))  # fmt: skip
    block_c = max(16, triton.next_power_of_2(latent_dim))  # tl.dot needs K >= 16
    part_out, part_lse = split_partials(out, num_splits)
    _mla_decode_split_kernel[(head_blocks, num_splits, batch)](
        q_latent, q_pe, cache, block_tables, seq_lens, out, part_out, part_lse,
        scale * LOG2E,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0),
        NUM_HEADS=heads, LATENT=latent_dim, ROPE=rope_dim, PAGE_SIZE=page_size,
        NUM_SPLITS=num_splits, BLOCK_H=block_h, BLOCK_C=block_c,
        BLOCK_R=max(16, triton.next_power_of_2(rope_dim)), BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q_latent.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    reduce_splits(part_out, part_lse, seq_lens, out, num_splits, block_n, block_c)
    return out


# ptxas on sm_90a (kernels.compile_report's method) for 16 heads and bf16: the [16, 512]
# float32 accumulator and the latent tiles held for mma fill the registers, so 4 warps
# with 32-token tiles already take 255 a thread; 16-token tiles (193) or 8 warps (177 at
# 32 tokens) avoid spills. The configs vary the tile, the warps and the split count
# (programs per SM: a launch's programs should fill whole waves); wider head blocks
# suit 128 heads (V3), where each cache tile then serves more query rows (32 heads with
# 8 warps: 222 registers, no spills; 64 spill, yet ran fastest at 128 heads on an H200).
# The first is the CPU default.
MLA_DECODE_CONFIGS = [
    dict(block_h=16, block_n=16, num_warps=4, num_stages=2, programs_per_sm=4),
    # At 16 heads on an H100 (bench/results/mla_sweep_s71a-c.json) 32-token tiles on 4 warps
    # read fastest, with fewer splits than 4 programs an SM asks for (4 at B 64 x 4k: 0.80
    # of the copy bandwidth against 0.75 at 8), and 64-token tiles on 8 warps came within 2%
    dict(block_h=16, block_n=32, num_warps=4, num_stages=2, programs_per_sm=2),
    dict(block_h=16, block_n=32, num_warps=4, num_stages=3, programs_per_sm=2),
    dict(block_h=16, block_n=32, num_warps=4, num_stages=4, programs_per_sm=2),
    dict(block_h=16, block_n=32, num_warps=4, num_stages=2, programs_per_sm=4),
    dict(block_h=16, block_n=64, num_warps=8, num_stages=2, programs_per_sm=2),
    dict(block_h=16, block_n=64, num_warps=8, num_stages=2, programs_per_sm=1),
    dict(block_h=16, block_n=32, num_warps=8, num_stages=2, programs_per_sm=2),
    # At 128 heads longer tiles ran faster (64 heads on 8 warps: 103, 157, 208 TFLOP/s at
    # 16, 32, 64 tokens): each tile's query reads and rescaling of the [64, 512]
    # accumulator then serve more tokens.
    dict(block_h=64, block_n=64, num_warps=8, num_stages=2, programs_per_sm=1),
]
# Tried at 128 heads on an H100 and dropped (bench/results/mla_sweep_s73a.json): 128-token
# tiles (159-169 TFLOP/s against 208-216 with 64), 16 warps (4 warpgroups, a quarter of the
# accumulator each: 73-112), all 128 heads in one program (ptxas: 158 registers a thread
# needed, 128 the most 16 warps can have).
# Dropped after the s71 sweeps, never within 6% of the fastest at any case there (a wider
# head block at 16 heads counted as the 16-head config it launches): 16-token tiles (but
# the first, the CPU default), 8 warps on 16-token tiles or at 4 and 8 programs an SM,
# 32-token tiles on 4 warps at 3 stages and 4 programs an SM, 64-token tiles on 4 warps,
# 32 and 64-head blocks on 16 and 32-token tiles. 20 configs became 14 then, 9 now; a
# shape first met compiles and times 8 of them at 16 heads or fewer, 9 at 128.
# Measured slower at 16 heads and dropped (bench/results/mla_sweep_s71a.json, _s71c.json): TMA
# copies of one page a tile (0.62 of the copy bandwidth at best), a register cap so 3 or 4
# programs fit an SM (0.50-0.58), the splits merged in the same launch by the last to
# finish (0.78 at B 64 x 4k, 0.65 at B 8 x 32k, where one program merges 32 partials).


def _bucket(q_latent, q_pe, cache, block_tables, seq_lens, scale, max_seq_len, out):
    return (
        next_power_of_2(q_latent.shape[0]), next_power_of_2(max_seq_len), q_latent.shape[1],
        q_latent.shape[2], q_pe.shape[2], str(q_latent.dtype), cache.shape[2],
    )  # fmt: skip


def _applies(config, q_latent, *rest) -> bool:
    """A head block wider than the heads (rounded up to a power of two, at least 16) is
    narrowed to them at launch: the same launch as a narrower config's, never timed twice."""
    return config["block_h"] <= max(16, next_power_of_2(q_latent.shape[1]))


SELECTOR = Selector(
    "mla_decode",
    {"split_kv": split_kv_mla_decode},
    {"split_kv": MLA_DECODE_CONFIGS},
    _bucket,
    # a candidate whose output parts from the first's is dropped, never chosen
    verify=close_outputs(ATTENTION_TOLERANCE),
    applies=_applies,
    revision="s72",  # choices made before the configs above were added are made again
)


def _check_query(name: str, x: torch.Tensor, like: torch.Tensor) -> None:
    if x.dim() != 3 or x.shape[:2] != like.shape[:2]:
        raise ValueError(f"{name} must be [batch, heads, dim] matching {tuple(like.shape[:2])}, "
                         f"got {tuple(x.shape)}")  # fmt: skip
    if x.dtype not in SUPPORTED_DTYPES or x.dtype != like.dtype or x.device != like.device:
        raise ValueError(f"{name} must be {like.dtype} on {like.device} (one of "
                         f"{SUPPORTED_DTYPES}), got {x.dtype} on {x.device}")  # fmt: skip
    if x.shape[2] > 0 and x.stride(2) != 1:
        raise ValueError(f"{name}'s last dimension must be contiguous (stride 1)")


def mla_decode_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA attention of one new query per sequence over its paged latents.

    q_latent [B, H, C] and q_pe [B, H, R] (any strides, unit last stride); cache
    [num_blocks, 1, block_size, 1, C + R] contiguous; block_tables [B, max_blocks] int32;
    seq_lens [B] int32 (including the new token; 0, a padding row, gives zeros);
    max_seq_len: a host-side upper bound of seq_lens (sets the split count only).
    Returns out [B, H, C] in q's dtype (see kernels.mla_reference.mla_decode).
    """
    if q_latent.dim() != 3:
        raise ValueError(f"q_latent must be [batch, heads, latent], got {tuple(q_latent.shape)}")
    _check_query("q_latent", q_latent, q_latent)
    _check_query("q_pe", q_pe, q_latent)
    batch, _, latent_dim = q_latent.shape
    width = latent_dim + q_pe.shape[2]
    if cache.dim() != 5 or cache.shape[1] != 1 or cache.shape[3] != 1 or cache.shape[4] != width:
        raise ValueError(f"cache must be [num_blocks, 1, block_size, 1, {width}] (latent + "
                         f"rope), got {tuple(cache.shape)}")  # fmt: skip
    if cache.dtype != q_latent.dtype or cache.device != q_latent.device:
        raise ValueError(f"cache must be {q_latent.dtype} on {q_latent.device}, got "
                         f"{cache.dtype} on {cache.device}")  # fmt: skip
    if not cache.is_contiguous() or cache.shape[2] < 1:
        raise ValueError("cache must be contiguous (block-major) with block_size >= 1")
    check_device(q_latent, _mla_decode_split_kernel)
    check_index("block_tables", block_tables, q_latent, (batch, None), rows_only=True)
    check_index("seq_lens", seq_lens, q_latent, (batch,))
    if not isinstance(max_seq_len, int) or max_seq_len < 0:
        raise ValueError(f"max_seq_len must be a non-negative Python int, got {max_seq_len!r}")
    if out is None:
        out = torch.empty_like(q_latent, memory_format=torch.contiguous_format)
    if out.shape != q_latent.shape or out.dtype != q_latent.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {q_latent.dtype} {tuple(q_latent.shape)} with unit last "
                         f"stride, got {out.dtype} {tuple(out.shape)}")  # fmt: skip
    if batch == 0:
        return out
    return SELECTOR(q_latent, q_pe, cache, block_tables, seq_lens, scale, max_seq_len, out)
