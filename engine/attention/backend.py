"""The attention backend interface and its torch reference implementation.

By the time a layer calls `attend`, the step's new keys and values are in
the paged cache (written by the fused rotary + cache-write operator); the
backend returns the attention output of every query row.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.attention.metadata import AttentionMetadata
from kernels import attention_reference


class AttentionBackend(Protocol):
    name: str

    def attend(
        self,
        q: torch.Tensor,  # [T, Hq, D], rotated
        k: torch.Tensor,  # [T, Hk, D], the step's new keys, rotated (also in the cache)
        v: torch.Tensor,  # [T, Hk, D], the step's new values (also in the cache)
        cache: torch.Tensor,  # [num_blocks, 2, block_size, Hk, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...  # [T, Hq, D]


class TorchAttentionBackend:
    name = "torch"
    graph_safe = False  # reads sequence lengths on the host

    def attend(self, q, k, v, cache, meta, scale):
        return attention_reference.paged_attention(
            q, cache, meta.block_tables, meta.query_lens_cpu, meta.seq_lens_cpu, scale
        )


_NAMES = ("torch", "triton")


def get_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose from {_NAMES}")
