"""DeepSeek-V3's multi-token prediction layer (checkpoint layer num_hidden_layers):
from the main model's final hidden state at position p and the token at p + 1,
a prediction of the token at p + 2. The token's embedding and the hidden state,
each normalized (enorm, hnorm), are joined and projected back to the hidden
width (eh_proj), go through one decoder layer of their own (with its own KV
cache), and the normalized result (shared_head.norm) meets the main model's
output head. The main model's embedding and head serve it (DeepSeek-V3 shares
them); the speculative decoder uses its predictions as drafts."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from basis.model_config import ModelConfig
from engine.models.layers import RMSNorm


def mtp_config(config: ModelConfig) -> ModelConfig:
    """The model's config with its MTP layer (index num_hidden_layers) counted as an
    MoE layer when the model routes experts, as DeepSeek-V3's is."""
    index = config.num_hidden_layers
    moe = config.moe_layers + ((index,) if config.num_experts else ())
    return dataclasses.replace(config, moe_layers=moe)


def has_mtp(config: ModelConfig) -> bool:
    """Whether the checkpoint carries a multi-token prediction layer."""
    return config.is_mla and int(config.raw.get("num_nextn_predict_layers") or 0) > 0


class MultiTokenPredictor(nn.Module):
    def __init__(self, config: ModelConfig, block: nn.Module):
        """`block`: its decoder layer, built by the model (decoder.py) for `mtp_config`,
        at index `num_hidden_layers`."""
        super().__init__()
        width, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(width, eps)
        self.hnorm = RMSNorm(width, eps)
        self.eh_proj = nn.Parameter(torch.empty(width, 2 * width))
        self.block = block
        self.norm = RMSNorm(width, eps)

    def forward(self, embedded, hidden, positions, cos_sin, cache, meta, backend):
        """(its hidden states, for the next prediction; their normalized form, for the head)."""
        x = F.linear(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1), self.eh_proj)
        h, residual = self.block(x, None, positions, cos_sin, cache, meta, backend)
        out = h + residual
        return out, self.norm(out)
