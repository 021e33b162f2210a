"""Attention through the Triton kernels: split-KV decode for all-decode
batches (graph-capturable), the varlen extend kernel for everything else;
for MLA, the absorbed split-KV decode over the latents and the expanded form
on the extend kernel."""

from __future__ import annotations

from kernels.decode_attention import decode_attention
from kernels.extend_attention import extend_attention
from kernels.mla_decode import mla_decode_attention
from kernels.mla_extend import mla_extend_attention


class TritonAttentionBackend:
    name = "triton"
    graph_safe = True  # the decode path reads no device values on the host

    def attend(self, q, k, v, cache, meta, scale):
        if meta.decode_only:
            return decode_attention(
                q, cache, meta.block_tables, meta.seq_lens, scale, meta.max_seq_len
            )
        return extend_attention(
            q,
            k,
            v,
            cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            meta.max_query_len,
            scale,
        )

    def mla_decode(self, q_latent, q_pe, cache, meta, scale):
        return mla_decode_attention(
            q_latent, q_pe, cache, meta.block_tables, meta.seq_lens, scale, meta.max_seq_len
        )

    def mla_extend(self, q, k, v, k_prefix, v_prefix, prefix_lens, meta, scale):
        return mla_extend_attention(
            q, k, v, k_prefix, v_prefix, meta.query_start_loc, meta.seq_lens, prefix_lens,
            meta.max_query_len, scale, page=16,
        )  # fmt: skip
