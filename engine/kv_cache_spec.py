"""The per-layer shape of the paged KV cache.

One tensor per layer, block-major: [num_blocks, components, block_size, heads, dim],
so each block's data of a layer is one contiguous piece (what KV transfer
moves). Grouped-query attention stores two components (keys and values) of
`num_kv_heads` heads; a compressed-latent attention (DeepSeek MLA) stores one
component of one "head" holding the latent and its rotary part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from basis.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    components: int  # 2: keys and values; 1: a single latent per token
    heads: int
    dim: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, config: ModelConfig, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        if config.is_mla:
            return cls.latent(config.num_hidden_layers, block_size, config.latent_dim, dtype)
        return cls(
            config.num_hidden_layers,
            block_size,
            2,
            config.num_key_value_heads,
            config.head_dim,
            dtype,
        )

    @classmethod
    def latent(
        cls, num_layers: int, block_size: int, latent_dim: int, dtype: torch.dtype
    ) -> KVCacheSpec:
        return cls(num_layers, block_size, 1, 1, latent_dim, dtype)

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.components, self.block_size, self.heads, self.dim)

    @property
    def bytes_per_block_per_layer(self) -> int:
        elems = self.components * self.block_size * self.heads * self.dim
        return elems * torch.finfo(self.dtype).bits // 8

    @property
    def bytes_per_block(self) -> int:
        """One block across all layers."""
        return self.bytes_per_block_per_layer * self.num_layers

    def blocks_in(self, nbytes: int) -> int:
        """The blocks `nbytes` hold, at least 2 (the null block and one to use)."""
        return max(2, nbytes // self.bytes_per_block)

    @property
    def bytes_per_token(self) -> int:
        """One token across all layers: what a context of n tokens costs, n times over."""
        return self.bytes_per_block // self.block_size

    def allocate(self, num_blocks: int, device) -> list[torch.Tensor]:
        cache = torch.zeros(
            (self.num_layers, *self.layer_shape(num_blocks)), dtype=self.dtype, device=device
        )
        return list(cache.unbind(0))
