"""DeepSeek-V2/V3 mixture of experts: routed experts on the fused MoE kernels
plus always-on shared experts, routed as transformers does.

The router computes in float32 from a float32 weight (and V3's correction
bias) whatever the model's dtype, as the checkpoints were trained and as
transformers keeps them (`_keep_in_fp32_modules_strict`): near-tied experts
then pick the same way in bf16 as in float32.
"""

from __future__ import annotations

import torch
from torch import nn

from basis.model_config import ModelConfig
from engine.models.layers import MLP, SparseMoE
from kernels import ops


class DeepseekMoE(SparseMoE):
    # Parameters build_model keeps in float32 when the model is cast to 16 bits.
    float32_params = ("gate", "e_score_correction_bias")

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.scoring = config.scoring_func
        self.greedy = config.topk_method == "greedy"
        self.num_groups, self.topk_group = config.n_group, config.topk_group
        self.scaling = config.routed_scaling_factor
        if self.scoring == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(torch.empty(config.num_experts))
        else:
            self.e_score_correction_bias = None
        width = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = MLP(config.hidden_size, width) if width else None

    def route(self, x):
        logits = self.skewed(ops.linear(x, self.gate))  # float32, as the gate is
        if self.greedy:  # V2 greedy: the plain softmax top-k, never renormalised
            weights, ids = ops.moe_route(logits, self.top_k, False)
            return (weights * self.scaling if self.scaling != 1.0 else weights), ids
        return ops.grouped_topk(
            logits, self.top_k, self.num_groups, self.topk_group, self.renormalize,
            self.scaling, self.scoring, self.e_score_correction_bias,
        )  # fmt: skip

    def dispatch(self, x):
        return x, super().dispatch(x)

    def shared_weights(self):
        mlp = self.shared_experts
        return None if mlp is None else (mlp.gate_up_proj, mlp.down_proj)

    def combine(self, sent):
        x, handle = sent
        if self.shared_experts is None or self.experts.runs_shared:
            return super().combine(handle)  # the experts' kernels added the shared ones
        # The shared experts run here while the routed ones may still be elsewhere.
        shared = self.shared_experts(x)
        return super().combine(handle) + shared
