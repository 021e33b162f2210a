"""The layers the decoders are built of: RMS norm, grouped-query attention, the
gated MLP and routed experts (`SparseMoE`, whose experts run where its
`ExpertBackend` says). `decoder.py` stacks them; `mla.py` and `deepseek_moe.py`
build DeepSeek's on them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from basis.model_config import ModelConfig
from engine.attention import AttentionBackend
from engine.expert_backend import LOCAL_EXPERTS, ExpertBackend
from engine.parallel import comm
from kernels import ops


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x, residual):
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = self.head_dim**-0.5
        out = self.q_size + 2 * self.kv_size
        self.qkv_proj = nn.Parameter(torch.empty(out, config.hidden_size))
        self.qkv_bias = nn.Parameter(torch.empty(out)) if config.attention_bias else None
        self.o_proj = nn.Parameter(torch.empty(config.hidden_size, self.q_size))
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, positions, cos_sin, cache, meta, backend: AttentionBackend):
        q, k, v = self.project(x, positions, cos_sin, cache, meta.slot_mapping)
        return self.output(backend.attend(q, k, v, cache, meta, self.scale))

    def project(self, x, positions, cos_sin, cache, slot_mapping):
        """(q, k, v) of the rows, rotated, their keys and values written to the cache."""
        qkv = ops.linear(x, self.qkv_proj, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rotary_cache_write(q, k, v, positions, cos_sin, cache, slot_mapping)
        return q, k, v

    def output(self, o):
        """The output projection of the attention's [T, heads, head_dim] result."""
        return comm.tp_reduce(ops.linear(o.reshape(-1, self.q_size), self.o_proj))


class MLP(nn.Module):
    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(hidden, width))

    def forward(self, x):
        out = ops.linear(ops.silu_and_mul(ops.linear(x, self.gate_up_proj)), self.down_proj)
        return comm.tp_reduce(out)


class SparseMoE(nn.Module):
    """Routed experts; each expert's gate and up rows are stacked in w13."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        e, h, w = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = nn.Parameter(torch.empty(e, h))
        self.w13 = nn.Parameter(torch.empty(e, 2 * w, h))
        self.w2 = nn.Parameter(torch.empty(e, h, w))
        # Tokens routed to each expert since the counter was last read; the
        # expert-balancing services read it.
        self.register_buffer("expert_load", torch.zeros(e, dtype=torch.int64), persistent=False)
        self.layer_index = -1  # set by the DecoderLayer
        self.experts: ExpertBackend = LOCAL_EXPERTS  # where the routed experts run
        self.router_bias = None  # benchmarks only: a skew added to the router logits

    def route(self, x):
        """(weights [T, k], expert ids [T, k]) of each token."""
        return ops.moe_route(self.skewed(F.linear(x, self.gate)), self.top_k, self.renormalize)

    def shared_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(gate_up [2S, H], down [H, S]) of an always-on expert added to the routed ones."""
        return None

    def skewed(self, logits):
        return logits if self.router_bias is None else logits + self.router_bias

    def forward(self, x):
        return self.combine(self.dispatch(x))

    def dispatch(self, x):
        """Routes the tokens and sends them to their experts; `combine` collects."""
        weights, ids = self.route(x)
        if not self.experts.counts_load:
            # index_add_ (not bincount) keeps this free of host syncs: graph-capturable.
            flat = ids.reshape(-1)
            self.expert_load.index_add_(0, flat, torch.ones_like(flat))
        return self.experts.dispatch(self, x, weights, ids)

    def combine(self, handle):
        return comm.tp_reduce(self.experts.combine(handle))
