"""What is fixed about an engine once it has started: what a worker advertises
to the scheduler, what a KV transport needs to agree on, and what the shared
tier checks a stored block against."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class EngineFacts:
    block_size: int  # tokens per KV block
    num_layers: int
    num_kv_blocks: int  # the device pool's
    max_num_seqs: int
    device: torch.device
    kv_dtype: torch.dtype
    kv_block_shape: tuple[int, ...]  # one block of one layer
    kv_block_bytes: int  # one block across every layer
    has_host_tier: bool
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_num_batched_tokens: int = 8192  # tokens in one step at most

    @property
    def kv_block_layout(self) -> str:
        """dtype and one block's shape across layers: what a stored block must match."""
        shape = ",".join(map(str, self.kv_block_shape))
        return f"{self.kv_dtype}:{self.num_layers}x{shape}"
