"""What the expert data-path tests share: a tiny MoE layer's weights and
the part of a SparseMoE a backend reads."""

from __future__ import annotations

import torch

E, H, W, TOP_K = 6, 16, 8, 2  # experts, hidden, expert width, experts a token


def moe_weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * W, H, generator=g) / 4, torch.randn(E, H, W, generator=g) / 4


class MoeStub:  # what a backend reads of a SparseMoE
    def __init__(self, w13, w2):
        self.w13, self.w2, self.layer_index = w13, w2, 0
