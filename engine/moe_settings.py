"""The engine options that shape how MoE layers run: ping-pong micro-batches
and, for benchmarks, a Zipf-shaped skew of the routing."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.micro_batch import MicroBatchPolicy
from engine.models.layers import SparseMoE


def moe_layers(model) -> list:
    """The model's SparseMoE modules (DeepSeek's included), in layer order."""
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]


def apply_moe_settings(model, config: EngineConfig) -> None:
    if config.micro_batches > 1:
        model.micro_batching = MicroBatchPolicy(
            config.micro_batches,
            config.micro_batch_decode_tokens,
            config.micro_batch_prefill_tokens,
        )
    if config.router_skew > 0:
        for moe in moe_layers(model):
            seed = config.seed * 1000 + moe.layer_index
            experts = moe.gate.shape[0]
            moe.router_bias = zipf_bias(experts, config.router_skew, seed, moe.gate.device)


def zipf_bias(num_experts: int, skew: float, seed: int, device) -> torch.Tensor:
    """s * log(1 / rank) per expert, ranks 1..E in a seeded random order: softmax
    routing then picks the expert of rank r about r^-s times as often as the first."""
    generator = torch.Generator().manual_seed(seed)
    ranks = torch.randperm(num_experts, generator=generator).float() + 1.0
    return (-skew * torch.log(ranks)).to(device)
