"""Paged MLA decode with TMA loads of the cache pages (Hopper+): the "tma" variant of
kernels/mla_decode.py's operator.

The same contract, grid, splits and merge as the pointer kernel there; only how a
tile of the cache is read differs. The cache [num_blocks, 1, PAGE, 1, C + R] is one
2-D tensor [num_blocks * PAGE, C + R], and a tile is one page: a [PAGE, C] box of
latents at (block_id * PAGE, 0) and a [PAGE, R] box of rope keys at column C. The TMA
engine copies both into shared memory, where the tensor cores read them, so the loop
holds no pointer tensors in registers (the pointer kernel's [BLOCK_N, C] gather costs
a register per element it addresses), and the software pipeliner keeps several pages
in flight while the math runs on the one before.

A page's rows past the sequence's end are its own page's unwritten slots (the block
is the sequence's): their scores are masked to -inf, and their latents, the values,
are zeroed, so that stale NaNs in free slots cannot reach the output through 0 * NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.3: host-side tensor descriptors
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None

from kernels.attention_checks import dot_precision
from kernels.decode_attention import (
    LOG2E,
    _sm_count,
    choose_num_splits,
    reduce_splits,
    split_partials,
)


@triton.jit
def _page_step(q_c, q_r, latent, k_pe, m_i, l_i, acc, qk_scale, keep, MASKED: tl.constexpr,
               DOT_PRECISION: tl.constexpr):  # fmt: skip
    """One online-softmax step (base 2) over a page: its latents are keys and values."""
    qk = tl.dot(q_c, tl.trans(latent), input_precision=DOT_PRECISION)
    qk = tl.dot(q_r, tl.trans(k_pe), qk, input_precision=DOT_PRECISION) * qk_scale
    if MASKED:  # slots past the end: no score, and zero values (0 * a stale NaN is NaN)
        qk = tl.where(keep[None, :], qk, float("-inf"))
        latent = tl.where(keep[:, None], latent, 0.0).to(latent.dtype)
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    acc = tl.dot(p.to(latent.dtype), latent, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _mla_decode_tma_kernel(
    q_ptr, q_pe_ptr, latent_desc, rope_desc, block_tables_ptr, seq_lens_ptr, out_ptr,
    part_out_ptr, part_lse_ptr,
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    stride_qb, stride_qh, stride_pb, stride_ph, stride_ob, stride_oh, stride_table,
    NUM_HEADS: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr,
    PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    head_block = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Whole pages per split (the merge sizes splits the same way, with BLOCK_N = PAGE).
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), PAGE_SIZE) * PAGE_SIZE
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if NUM_SPLITS > 1:
        if start >= end:  # past this sequence's end: the merge skips this split
            return

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, LATENT)
    offs_r = tl.arange(0, ROPE)
    offs_n = tl.arange(0, PAGE_SIZE)
    h_ok = heads < NUM_HEADS
    q_c = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_c[None, :],
                  mask=h_ok[:, None], other=0.0)  # fmt: skip
    q_r = tl.load(q_pe_ptr + seq * stride_pb + heads[:, None] * stride_ph + offs_r[None, :],
                  mask=h_ok[:, None], other=0.0)  # fmt: skip
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, LATENT], dtype=tl.float32)
    # Whole pages, unmasked; then the page the sequence ends inside, if any (splits are
    # whole pages, so only a sequence's last split has one).
    whole_end = end - (end - start) % PAGE_SIZE
    for page_start in range(start, whole_end, PAGE_SIZE):
        row = tl.load(table_ptr + page_start // PAGE_SIZE) * PAGE_SIZE
        m_i, l_i, acc = _page_step(q_c, q_r, latent_desc.load([row, 0]), rope_desc.load([row, 0]),
                                   m_i, l_i, acc, qk_scale, offs_n, False,
                                   DOT_PRECISION)  # fmt: skip
    if whole_end < end:
        row = tl.load(table_ptr + whole_end // PAGE_SIZE) * PAGE_SIZE
        m_i, l_i, acc = _page_step(q_c, q_r, latent_desc.load([row, 0]), rope_desc.load([row, 0]),
                                   m_i, l_i, acc, qk_scale, whole_end + offs_n < end, True,
                                   DOT_PRECISION)  # fmt: skip

    if NUM_SPLITS == 1:
        result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a padding row (length 0): zeros
        o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_c[None, :]
        tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
    else:
        part = (seq * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * LATENT + offs_c[None, :], acc / l_i[:, None],
                 mask=h_ok[:, None])  # fmt: skip
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=h_ok)


def tma_device_ok(device: torch.device) -> bool:
    """Whether this device and Triton build can run the kernel (sm_90 or newer)."""
    if TensorDescriptor is None or not hasattr(tl, "make_tensor_descriptor"):
        return False
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def _power_of_2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def tma_inputs_ok(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor) -> bool:
    """Shapes the boxes can take: power-of-two widths and pages of 16 to 256 tokens
    (tl.dot needs 16 rows), 16-bit elements, 16-byte aligned rows and rope column."""
    latent, rope, page = q_latent.shape[2], q_pe.shape[2], cache.shape[2]
    size = cache.element_size()
    return (
        size == 2
        and _power_of_2(latent) and latent >= 16 and _power_of_2(rope) and rope >= 16
        and _power_of_2(page) and 16 <= page <= 256
        and ((latent + rope) * size) % 16 == 0 and cache.data_ptr() % 16 == 0
    )  # fmt: skip


def cache_descriptors(cache: torch.Tensor, latent: int, rope: int):
    """The [PAGE, latent] and [PAGE, rope] boxes over the cache as rows of latent + rope."""
    page = cache.shape[2]
    rows = cache.view(-1, latent + rope)
    return (
        TensorDescriptor.from_tensor(rows[:, :latent], [page, latent]),
        TensorDescriptor.from_tensor(rows[:, latent:], [page, rope]),
    )


def tma_mla_decode(
    q_latent, q_pe, cache, block_tables, seq_lens, scale, max_seq_len, out,
    *, block_h, num_warps, num_stages, programs_per_sm, num_splits=None, fallback=None,
):  # fmt: skip
    """One launch with an explicit config; inputs already checked. Shapes the boxes cannot
    take go to `fallback` (the pointer kernel's launcher) with its own default config."""
    batch, heads, latent_dim = q_latent.shape
    rope_dim, page_size = q_pe.shape[2], cache.shape[2]
    if not tma_inputs_ok(q_latent, q_pe, cache):
        if fallback is None:
            raise ValueError("the TMA MLA decode kernel cannot read this cache layout")
        return fallback(q_latent, q_pe, cache, block_tables, seq_lens, scale, max_seq_len, out)
    block_h = max(16, min(block_h, triton.next_power_of_2(heads)))  # tl.dot needs M >= 16
    head_blocks = triton.cdiv(heads, block_h)
    if num_splits is None:
        num_splits = choose_num_splits(batch, head_blocks, max_seq_len, page_size,
                                       programs_per_sm, _sm_count(q_latent.device))  # fmt: skip
    part_out, part_lse = split_partials(out, num_splits)
    latent_desc, rope_desc = cache_descriptors(cache, latent_dim, rope_dim)
    _mla_decode_tma_kernel[(head_blocks, num_splits, batch)](
        q_latent, q_pe, latent_desc, rope_desc, block_tables, seq_lens, out, part_out, part_lse,
        scale * LOG2E,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0),
        NUM_HEADS=heads, LATENT=latent_dim, ROPE=rope_dim, PAGE_SIZE=page_size,
        NUM_SPLITS=num_splits, BLOCK_H=block_h, DOT_PRECISION=dot_precision(q_latent.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    reduce_splits(part_out, part_lse, seq_lens, out, num_splits, page_size, latent_dim)
    return out
