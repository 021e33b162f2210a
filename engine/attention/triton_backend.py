"""Attention through the Triton kernels: split-KV decode for all-decode
batches (graph-capturable) and, with `split_decodes`, for the one-token sequences
of a mixed step; the varlen extend kernel for the prompt chunks;
for MLA, the absorbed split-KV decode over the latents and the expanded form
on the extend kernel."""

from __future__ import annotations

import torch

from kernels.decode_attention import decode_attention
from kernels.extend_attention import extend_attention
from kernels.mla_decode import mla_decode_attention
from kernels.mla_extend import mla_extend_attention

# one-token sequences in a mixed step from which they go through the decode kernel: its
# launches (host time) against a tile of query rows each in the extend kernel (device time)
SPLIT_DECODES = 8
# the decodes that go apart, a multiple of this: the extend kernel's index tensors then
# start 16-byte aligned past them, as Triton specializes its pointers (a misaligned start
# would compile the kernel again, mid-step)
SPLIT_ALIGN = 4


class TritonAttentionBackend:
    name = "triton"
    graph_safe = True  # the decode path reads no device values on the host
    # None: a mixed step's decodes stay in the extend kernel. The piece graphs set it
    # (engine/piece_graphs.py). Eager, below saturation, a step waits on its launch, and the
    # decode kernel's launches cost it more host time than they save device time (one H100:
    # a step of 80 decodes and a 1,024-token prompt, launch 35.6 -> 44.8 ms, device 41.3 ->
    # 28.2 ms; bench/results/split_s79_*); an eager step past the pieces' 2,048 tokens has
    # more device work than launch time, so there the split pays.
    split_decodes: int | None = None
    # the length bound the split's decode calls give the kernel: the decode graphs' (the
    # model's context), so their kernel choices, tuned at capture, serve these calls too
    split_max_len = 0

    def split_mixed_steps(self, max_len: int) -> None:
        """From now on a mixed step's decodes (SPLIT_DECODES or more) go apart; `max_len`:
        the decode graphs' length bound."""
        self.split_decodes, self.split_max_len = SPLIT_DECODES, max_len

    def attend(self, q, k, v, cache, meta, scale, out=None):
        if meta.decode_only:
            return decode_attention(
                q, cache, meta.block_tables, meta.seq_lens, scale, meta.max_seq_len, out=out
            )
        d = meta.num_decodes // SPLIT_ALIGN * SPLIT_ALIGN if self.split_decodes else 0
        if self.split_decodes is None or d < self.split_decodes:
            return extend_attention(
                q, k, v, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                meta.max_query_len, scale, out=out,
            )  # fmt: skip
        # A mixed step: its leading one-token sequences through the decode kernel (the
        # extend kernel would give each of them a whole tile of query rows), the rest after
        # them through the extend kernel, into one output.
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        decode_attention(q[:d], cache, meta.block_tables[:d], meta.seq_lens[:d], scale,
                         max(self.split_max_len, 1), out=out[:d])  # fmt: skip
        extend_attention(
            q, k, v, cache, meta.block_tables[d:], meta.query_start_loc[d:], meta.seq_lens[d:],
            meta.max_query_len, scale, out=out,
        )  # fmt: skip
        return out

    def mla_decode(self, q_latent, q_pe, cache, meta, scale):
        return mla_decode_attention(
            q_latent, q_pe, cache, meta.block_tables, meta.seq_lens, scale, meta.max_seq_len
        )

    def mla_extend(self, q, k, v, k_prefix, v_prefix, prefix_lens, meta, scale):
        return mla_extend_attention(
            q, k, v, k_prefix, v_prefix, meta.query_start_loc, meta.seq_lens, prefix_lens,
            meta.max_query_len, scale, page=16,
        )  # fmt: skip
