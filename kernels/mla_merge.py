"""The MLA decode's split merge inside its own launch: the last split of a (sequence,
head block) to finish merges every split's partial output, so no second launch reads
the partials back (from L2, where they were just written, rather than from DRAM after
the latent stream has flushed them).

Each program stores its partial output and log-sum-exp, waits at a barrier for all
its threads' stores, then takes a ticket (one atomic add, acquire-release at GPU
scope). The program whose ticket completes the count has seen every other split's
stores; it resets the ticket to zero for the next launch and merges. Tickets live in
one int32 buffer per device and stream, allocated zeroed outside CUDA graph capture;
a launch that would need a larger buffer during capture is not fused.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TICKETS: dict[tuple[str, int], torch.Tensor] = {}


def tickets(device: torch.device, count: int) -> torch.Tensor | None:
    """A zeroed int32 buffer of at least `count` tickets for launches on the current
    stream of `device`; None when it must grow while a CUDA graph is being captured."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    found = _TICKETS.get(key)
    if found is not None and found.numel() >= count:
        return found
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    size = max(count, 2 * (found.numel() if found is not None else 0), 256)
    _TICKETS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return _TICKETS[key]


@triton.jit
def merge_if_last(
    ticket_ptr, part_out_ptr, part_lse_ptr, out_ptr, seq, heads, h_ok, live,
    stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, LATENT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """After this program's partials are stored: the last of the `live` splits merges."""
    tl.debug_barrier()  # every thread's stores come before the ticket
    done = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    if done == live - 1:
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next launch
        offs_c = tl.arange(0, BLOCK_C)
        mask = h_ok[:, None] & (offs_c < LATENT)[None, :]
        m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
        for s in range(0, live):
            row = (seq * NUM_HEADS + heads) * NUM_SPLITS + s
            # .cg: from L2, where the other programs' stores are, never a stale L1 line
            lse = tl.load(part_lse_ptr + row, mask=h_ok, other=0.0, cache_modifier=".cg")
            part = tl.load(part_out_ptr + row[:, None] * LATENT + offs_c[None, :], mask=mask,
                           other=0.0, cache_modifier=".cg")  # fmt: skip
            m_new = tl.maximum(m, lse)
            keep = tl.exp2(m - m_new)
            weight = tl.exp2(lse - m_new)
            acc = acc * keep[:, None] + part * weight[:, None]
            total = total * keep + weight
            m = m_new
        o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_c[None, :]
        tl.store(o_ptrs, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def zero_padding_row(out_ptr, seq, heads, h_ok, stride_ob, stride_oh, LATENT: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    """A sequence of length 0 (a padded batch row) gets zeros, as the merge launch writes."""
    offs_c = tl.arange(0, BLOCK_C)
    mask = h_ok[:, None] & (offs_c < LATENT)[None, :]
    o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_c[None, :]
    tl.store(o_ptrs, tl.zeros([BLOCK_H, BLOCK_C], dtype=out_ptr.dtype.element_ty), mask=mask)
