"""DeepSeek-V2/V3 multi-head latent attention (MLA) over a latent KV cache.

Per token, `kv_a_proj_with_mqa` gives a compressed KV latent c (kv_lora_rank)
and one rotary key k_pe shared by all heads; the cache stores [RMSNorm(c) |
rotated k_pe] (576 values at V2/V3 widths, against 2 * heads * head_dim for
ordinary attention). `kv_b_proj` holds, per head, W_UK (latent -> key) and
W_UV (latent -> value).

A step attends in one of two forms (both exact, they differ only by rounding):
- all-decode steps use the absorbed form: q_latent = W_UK^T q_nope per head, an
  MQA over the latents (keys [c | k_pe], values c), then W_UV on the latent
  output. Nothing per head is ever materialised for the context, so decode
  reads only the cache;
- every other step (prefill, chunks, mixed batches) uses the expanded form: the
  new tokens' latents and each sequence's cached prefix are expanded into
  per-head keys [k_nope | k_pe] and values, then ordinary causal attention.
  Expanding costs a matmul per cached token, which a prefill's own compute
  dwarfs, and keeps the attention a standard (tensor-core friendly) one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from basis.model_config import ModelConfig
from engine.attention import AttentionBackend, AttentionMetadata
from engine.attention.mla_prefix import prefix_latents
from engine.models.layers import RMSNorm
from engine.parallel import comm
from kernels import ops

# transformers builds q_a_layernorm and kv_a_layernorm with their default eps,
# not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, norm_class):
        super().__init__()
        self.num_heads = heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.rank = config.v_head_dim, config.kv_lora_rank
        self.qk_dim = self.nope_dim + self.rope_dim
        self.q_lora_rank = config.q_lora_rank
        # q (or q's LoRA down-projection) and kv_a_proj_with_mqa read the same input:
        # one GEMM, split after.
        self.q_in = self.q_lora_rank or heads * self.qk_dim
        self.fused_qkv_a_proj = nn.Parameter(
            torch.empty(self.q_in + config.latent_dim, config.hidden_size)
        )
        if self.q_lora_rank is not None:
            self.q_a_layernorm = norm_class(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Parameter(torch.empty(heads * self.qk_dim, self.q_lora_rank))
        self.kv_a_layernorm = norm_class(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Parameter(torch.empty(heads * (self.nope_dim + self.v_dim), self.rank))
        self.o_proj = nn.Parameter(torch.empty(config.hidden_size, heads * self.v_dim))
        self.scale = config.attention_scale
        self.interleaved = config.rope_interleave

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        cache: torch.Tensor,  # [num_blocks, 1, block_size, 1, kv_lora_rank + qk_rope_head_dim]
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        q_a, kv_a = ops.linear(x, self.fused_qkv_a_proj).split(
            [self.q_in, self.rank + self.rope_dim], dim=-1
        )
        q = q_a if self.q_lora_rank is None else ops.linear(self.q_a_layernorm(q_a), self.q_b_proj)
        q = q.view(-1, self.num_heads, self.qk_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        k_pe = kv_a[:, None, self.rank :]
        norm, latent = self.kv_a_layernorm, kv_a[:, : self.rank]
        # A decode step only caches the latent: a plain RMSNorm is then applied by the
        # kernel that writes it.
        fused = meta.decode_only and type(norm) is RMSNorm
        if not fused:
            latent = norm(latent)
        q_pe, k_pe = ops.mla_rotary_cache_write(
            q_pe, k_pe, latent, positions, cos_sin, cache, meta.slot_mapping, self.interleaved,
            *((norm.weight, norm.eps) if fused else ()),
        )  # fmt: skip
        if meta.decode_only:
            out = self._absorbed(q_nope, q_pe, cache, meta, backend)
        else:
            q = torch.cat([q_nope, q_pe], dim=-1)
            out = self._expanded(q, latent, k_pe, cache, meta, backend)
        return comm.tp_reduce(ops.linear(out.reshape(-1, self.num_heads * self.v_dim), self.o_proj))

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, rank] and W_UV [H, v, rank]: views of kv_b_proj."""
        w = self.kv_b_proj.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def _absorbed(self, q_nope, q_pe, cache, meta, backend) -> torch.Tensor:
        w_uk, w_uv = self._up_projections()
        # Per head: [T, nope] @ [nope, rank]. Batched over heads, the [H, T, .] results
        # are read back through strides, never copied to [T, H, .].
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        latent_out = backend.mla_decode(q_latent, q_pe, cache, meta, self.scale)
        # Written through strides straight into [T, H, v], which o_proj reads as [T, H * v]
        # (cuBLAS takes the row stride H * v): no copy to that layout after.
        out = latent_out.new_empty(latent_out.shape[0], self.num_heads, self.v_dim)
        torch.bmm(latent_out.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
        return out

    def _expand(self, latent: torch.Tensor, k_pe: torch.Tensor):
        """Per-head keys [N, H, nope + rope] and values [N, H, v] of N tokens' latents."""
        kv = F.linear(latent, self.kv_b_proj).view(-1, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, self.num_heads, -1)], dim=-1)
        return k, v

    def _expanded(self, q, latent, k_pe, cache, meta, backend) -> torch.Tensor:
        k, v = self._expand(latent, k_pe)
        cached, prefix_lens = prefix_latents(cache, meta)
        k_prefix, v_prefix = self._expand(cached[:, : self.rank], cached[:, None, self.rank :])
        return backend.mla_extend(q, k, v, k_prefix, v_prefix, prefix_lens, meta, self.scale)
