"""The attention backend interface and its torch reference implementation.

By the time a layer calls `attend`, the step's new keys and values are in
the paged cache (written by the fused rotary + cache-write operator); the
backend returns the attention output of every query row.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.attention.metadata import AttentionMetadata
from kernels import attention_reference, mla_reference


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
        out: torch.Tensor | None = None,  # [T, Hq, D] contiguous: written and returned
    ) -> torch.Tensor: ...  # [T, Hq, D]

    # Multi-head latent attention (kernels/mla_reference.py defines both forms).
    def mla_decode(
        self,
        q_latent: torch.Tensor,  # [B, H, C]: W_UK^T q_nope
        q_pe: torch.Tensor,  # [B, H, R], rotated
        cache: torch.Tensor,  # [num_blocks, 1, block_size, 1, C + R]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...  # [B, H, C], the latent output

    def mla_extend(
        self,
        q: torch.Tensor,  # [T, H, Dqk]
        k: torch.Tensor,  # [T, H, Dqk], the new tokens' expanded keys
        v: torch.Tensor,  # [T, H, Dv]
        k_prefix: torch.Tensor,  # [P, H, Dqk], every sequence's cached prefix, expanded
        v_prefix: torch.Tensor,  # [P, H, Dv]
        prefix_lens: list[int],
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...  # [T, H, Dv]


class TorchAttentionBackend:
    name = "torch"
    graph_safe = False  # reads sequence lengths on the host

    def attend(self, q, k, v, cache, meta, scale, out=None):
        o = attention_reference.paged_attention(
            q, cache, meta.block_tables, meta.query_lens_cpu, meta.seq_lens_cpu, scale
        )
        return o if out is None else out.copy_(o)

    def mla_decode(self, q_latent, q_pe, cache, meta, scale):
        return mla_reference.mla_decode(
            q_latent, q_pe, cache, meta.block_tables, meta.seq_lens, scale
        )

    def mla_extend(self, q, k, v, k_prefix, v_prefix, prefix_lens, meta, scale):
        return mla_reference.mla_extend(
            q, k, v, k_prefix, v_prefix, meta.query_lens_cpu, prefix_lens, scale
        )


_NAMES = ("torch", "triton")


def get_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose from {_NAMES}")
