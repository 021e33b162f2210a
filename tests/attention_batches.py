"""Batches for the attention kernels' tests: random queries over a paged cache with
scattered block ids, and the mixed batch (decode rows, fresh prompts, chunks after
cached prefixes) both the kernels' and the kernel selection's tests run."""

from __future__ import annotations

import numpy as np
import torch

from kernels.attention_reference import gather_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 0.37


def make_batch(query_lens, seq_lens, kv_heads, group, head_dim, block_size, dtype, seed=0):
    """Random q and paged cache; k, v are the new tokens' rows, read back from the cache."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = 2 * sum(pages) + 3
    cache = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=gen)
    block_ids = torch.randperm(num_blocks, generator=gen)  # scattered, not consecutive
    block_tables = torch.zeros(len(seq_lens), max(pages) + 2, dtype=torch.int32)
    used = 0
    for i, count in enumerate(pages):
        block_tables[i, :count] = block_ids[used : used + count]
        used += count
    q = torch.randn(sum(query_lens), kv_heads * group, head_dim, generator=gen)
    ks, vs = [], []
    for i, (n, length) in enumerate(zip(query_lens, seq_lens)):
        k, v = gather_kv(cache, block_tables[i], length)
        ks.append(k[length - n :])
        vs.append(v[length - n :])
    starts = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)

    def dev(x):
        return x.to(DEVICE, dtype if x.is_floating_point() else x.dtype)

    return dict(
        q=dev(q), k=dev(torch.cat(ks)), v=dev(torch.cat(vs)), cache=dev(cache),
        block_tables=dev(block_tables), query_start_loc=dev(starts),
        seq_lens=dev(torch.tensor(seq_lens, dtype=torch.int32)),
    )  # fmt: skip


# A decode row, a fresh prompt, a chunk after a cached prefix, a chunk ending on a page
# boundary after a prefix ending on one (16 + 16), and a one-token prompt.
MIXED = ([1, 37, 5, 16, 1], [20, 37, 21, 32, 1])
CAPABILITY = torch.cuda.get_device_capability() if DEVICE == "cuda" else None
