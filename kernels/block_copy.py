"""Copying KV blocks between caches: `dst[dst_ids] = src[src_ids]` for whole
blocks of one layer, on the device, in as few passes over memory as the ids
allow. Used wherever blocks move within or between GPUs of one host (the
cuda_ipc transport, tier copies).

A plan is worked out once per set of ids: runs of consecutive ids are plain
copies (one pass each, peer to peer across GPUs); scattered ids on one device
are one Triton launch (a program per block and chunk, one read and one write,
any ids); the torch fallbacks gather into a range or scatter from one.
Tensors are viewed as [blocks, words] of the widest integer that divides a
block, so every path moves bytes, whatever the cache's dtype.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - no Triton: two-pass torch copies instead
    triton = None

MAX_RUNS = 8  # this many runs of consecutive ids or fewer: one plain copy per run


def _start_if_range(ids: list[int]) -> int | None:
    return ids[0] if ids and ids == list(range(ids[0], ids[0] + len(ids))) else None


@dataclass
class CopyPlan:
    """How one request's blocks move, worked out once in begin()."""

    src_ids: list[int]
    dst_ids: list[int]
    runs: list[tuple[int, int, int]]  # (src start, dst start, length), both consecutive
    src_start: int | None  # src ids are one ascending range starting here
    dst_start: int | None
    src_index: torch.Tensor | None  # on the source device
    dst_index: torch.Tensor | None  # on the destination device


def make_copy_plan(src_ids, dst_ids, src_index=None, dst_index=None) -> CopyPlan:
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and (s, d) == (runs[-1][0] + runs[-1][2], runs[-1][1] + runs[-1][2]):
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    start_s, start_d = _start_if_range(src_ids), _start_if_range(dst_ids)
    return CopyPlan(list(src_ids), list(dst_ids), runs, start_s, start_d, src_index, dst_index)


if triton is not None:

    @triton.jit
    def _copy_blocks_kernel(src, dst, src_ids, dst_ids, words, CHUNK: tl.constexpr):
        # Program (i, c) copies chunk c of block pair i: one read, one write, any ids.
        s = tl.load(src_ids + tl.program_id(0)).to(tl.int64)
        d = tl.load(dst_ids + tl.program_id(0)).to(tl.int64)
        offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        mask = offs < words
        tl.store(dst + d * words + offs, tl.load(src + s * words + offs, mask=mask), mask=mask)


def _words(src: torch.Tensor, dst: torch.Tensor) -> list[torch.Tensor]:
    """Both as [blocks, words] of the widest integer that fits: fewer, wider accesses.
    `view`, never `reshape`: writing into a silent copy would lose the data."""
    flat = [t.view(t.shape[0], -1) for t in (src, dst)]
    for dtype in (torch.int64, torch.int32, torch.int16):
        if (flat[0].shape[1] * flat[0].element_size()) % dtype.itemsize == 0:
            with contextlib.suppress(RuntimeError):  # a misaligned storage offset
                return [t.view(dtype) for t in flat]
    return flat


def triton_copy(src: torch.Tensor, dst: torch.Tensor, p: CopyPlan) -> None:
    """The Triton kernel on its own (copy_blocks picks it for scattered ids on CUDA)."""
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(
            f"blocks differ: {src.dtype}{tuple(src.shape[1:])} vs {dst.dtype}{tuple(dst.shape[1:])}"
        )
    if p.src_index is None or p.dst_index is None:
        raise ValueError("the Triton copy needs the plan's index tensors")
    if not p.src_ids:
        return
    src, dst = _words(src, dst)
    chunk = 1024
    grid = (len(p.src_ids), triton.cdiv(src.shape[1], chunk))
    _copy_blocks_kernel[grid](src, dst, p.src_index, p.dst_index, src.shape[1], CHUNK=chunk)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, p: CopyPlan) -> None:
    """dst[p.dst_ids] = src[p.src_ids] on the current stream(s), in as few passes as it can."""
    n = len(p.src_ids)
    if len(p.runs) <= MAX_RUNS:  # plain copies, each one pass, peer-to-peer if need be
        for s, d, k in p.runs:
            dst[d : d + k].copy_(src[s : s + k], non_blocking=True)
        return
    same = src.device == dst.device
    if same and src.is_cuda and triton is not None:
        triton_copy(src, dst, p)
        return
    src, dst = _words(src, dst)  # the torch paths below: same bytes, wider elements
    if same and p.dst_start is not None:  # gather straight into the destination range
        torch.index_select(src, 0, p.src_index, out=dst[p.dst_start : p.dst_start + n])
        return
    if p.src_start is not None:
        packed = src[p.src_start : p.src_start + n]  # a view: scatter is the only pass
    else:
        packed = src.index_select(0, p.src_index)
    if not same:
        if p.dst_start is not None:
            dst[p.dst_start : p.dst_start + n].copy_(packed, non_blocking=True)
            return
        packed = packed.to(dst.device, non_blocking=True)  # one peer copy
    dst.index_copy_(0, p.dst_index, packed)
