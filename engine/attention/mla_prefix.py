"""The cached prefix of every sequence of a step, as latents (MLA's expanded form).

A prefill chunk after a prefix-cache hit, or after earlier chunks, attends over
tokens it did not compute: their latents are in the paged cache and are read
back here, to be expanded into per-head keys and values. The slots are worked
out once per step, on the device, and shared by every layer.
"""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata
from kernels.mla_reference import gather_latents


def prefix_lengths(meta: AttentionMetadata) -> list[int]:
    return [s - q for s, q in zip(meta.seq_lens_cpu, meta.query_lens_cpu)]


def prefix_slots(meta: AttentionMetadata, block_size: int) -> torch.Tensor:
    """[sum of prefix lengths] int64: the cache slot of each cached prefix token."""
    if meta.prefix_slots is None:
        lengths = prefix_lengths(meta)
        total = sum(lengths)
        device = meta.block_tables.device
        counts = torch.tensor(lengths, device=device)
        seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), counts,
                                      output_size=total)  # fmt: skip
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.arange(total, device=device) - starts[seq]
        blocks = meta.block_tables[seq, pos // block_size].long()
        meta.prefix_slots = blocks * block_size + pos % block_size
    return meta.prefix_slots


def prefix_latents(cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, list[int]]:
    """([P, C + R] cache entries of every sequence's prefix, in order; the lengths)."""
    return gather_latents(cache, prefix_slots(meta, cache.shape[2])), prefix_lengths(meta)
