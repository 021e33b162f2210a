"""The attention backend interface and its torch reference implementation.

A backend stores the step's new keys and values into the paged cache and
returns attention outputs for every query row. Models call only this.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.attention.metadata import AttentionMetadata
from kernels import attention_reference, reference


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hk, D]
        v: torch.Tensor,  # [T, Hk, D]
        cache: torch.Tensor,  # [num_blocks, 2, block_size, Hk, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...  # [T, Hq, D]


class TorchAttentionBackend:
    name = "torch"

    def forward(self, q, k, v, cache, meta, scale):
        reference.write_kv_cache(k, v, cache, meta.slot_mapping)
        return attention_reference.paged_attention(
            q, cache, meta.block_tables, meta.query_lens_cpu, meta.seq_lens_cpu, scale
        )


_BACKENDS = {"torch": TorchAttentionBackend}


def get_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(_BACKENDS)}")
    return _BACKENDS[name]()
