"""The MLA Triton kernels against their torch references (Triton's interpreter
off CUDA): the absorbed paged decode, the expanded extend, the fused rotary +
latent cache write. Odd latent widths, one-token sequences, page boundaries,
mixed lengths, scattered blocks."""

from __future__ import annotations

import pytest
import torch

from kernels import mla_reference
from kernels.mla_decode import MLA_DECODE_CONFIGS, mla_decode_attention, split_kv_mla_decode
from kernels.mla_extend import mla_extend_attention
from kernels.mla_rotary import mla_rotary_cache_write
from kernels.norm import rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}
SCALE = 0.29


def randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def paged_latents(seq_lens, block_size, width, dtype, seed=0):
    """A cache [num_blocks, 1, block_size, 1, width] and scattered block tables."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = 2 * sum(pages) + 3
    cache = torch.randn(num_blocks, 1, block_size, 1, width, generator=gen)
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(pages) + 1, dtype=torch.int32)
    used = 0
    for i, count in enumerate(pages):
        tables[i, :count] = ids[used : used + count]
        used += count
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return cache.to(DEVICE, dtype), tables.to(DEVICE), lens.to(DEVICE)


def decode_inputs(seq_lens, heads, latent_dim, rope_dim, block_size, dtype, seed=0):
    cache, tables, lens = paged_latents(seq_lens, block_size, latent_dim + rope_dim, dtype, seed)
    # q_latent as the model makes it: a [H, B, C] bmm result read through a transpose.
    q_latent = randn(heads, len(seq_lens), latent_dim, seed=seed + 1, dtype=dtype).transpose(0, 1)
    q_pe = randn(len(seq_lens), heads, rope_dim, seed=seed + 2, dtype=dtype)
    return q_latent, q_pe, cache, tables, lens


def reference_decode(q_latent, q_pe, cache, tables, lens):
    cpu = [x.float().cpu() for x in (q_latent, q_pe, cache)]
    return mla_reference.mla_decode(*cpu, tables.cpu(), lens.cpu(), SCALE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "heads,latent_dim,rope_dim,block_size",
    [(4, 32, 8, 16), (1, 48, 16, 5), (20, 24, 6, 16)],  # 20 heads: two head blocks of 16
)
def test_decode_matches_reference(dtype, heads, latent_dim, rope_dim, block_size):
    seq_lens = [1, 16, 17, 37, 5]  # one token, a page boundary and one past it, mixed
    inputs = decode_inputs(seq_lens, heads, latent_dim, rope_dim, block_size, dtype)
    out = mla_decode_attention(*inputs[:3], inputs[3], inputs[4], SCALE, max(seq_lens))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float().cpu(), reference_decode(*inputs), atol=tol, rtol=tol)


def test_decode_does_not_depend_on_splits_and_pads_with_zeros():
    seq_lens = [1, 150, 64, 0]  # the last row is padding (length 0)
    inputs = decode_inputs(seq_lens, 3, 40, 8, 8, torch.float32, seed=5)
    expected = reference_decode(*inputs)
    assert torch.equal(expected[3], torch.zeros_like(expected[3]))
    for num_splits in (1, 3, 8):  # 8 leaves splits past the end of most sequences
        out = split_kv_mla_decode(
            *inputs, SCALE, 150, torch.full(inputs[0].shape, float("nan"), device=DEVICE),
            **MLA_DECODE_CONFIGS[0], num_splits=num_splits,
        )  # fmt: skip
        torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_decode_tunes_only_head_blocks_its_heads_need():
    """A head block wider than the heads would launch as a narrower config: never timed."""
    from kernels.mla_decode import SELECTOR

    for heads, widest in ((3, 16), (16, 16), (40, 64), (128, 64)):
        inputs = decode_inputs([5], heads, 16, 8, 4, torch.float32)
        suiting = SELECTOR.suiting(SELECTOR.candidates, (*inputs, SCALE, 5, None))
        blocks = {c.kwargs["block_h"] for c in suiting}
        assert max(blocks) == widest and suiting[0] == SELECTOR.candidates[0]
        wider = [c for c in SELECTOR.candidates if c.kwargs["block_h"] > widest]
        assert len(suiting) + len(wider) == len(SELECTOR.candidates)


def test_decode_rejects_bad_inputs():
    q_latent, q_pe, cache, tables, lens = decode_inputs([3, 9], 2, 16, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="cache must be"):
        mla_decode_attention(q_latent, q_pe, cache[..., :-1], tables, lens, SCALE, 9)
    with pytest.raises(ValueError, match="q_pe"):
        mla_decode_attention(q_latent, q_pe[:1], cache, tables, lens, SCALE, 9)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        mla_decode_attention(q_latent, q_pe, cache, tables, lens.long(), SCALE, 9)
    with pytest.raises(ValueError, match="max_seq_len"):
        mla_decode_attention(q_latent, q_pe, cache, tables, lens, SCALE, 9.0)


@pytest.mark.parametrize("page", [16, 3])
def test_extend_matches_reference(page):
    """A fresh prompt, chunks after prefixes ending inside and on a page, a decode row."""
    query_lens, prefix_lens = [37, 5, 16, 1, 7], [0, 16, 16, 20, 33]
    heads, qk_dim, v_dim = 3, 24, 16
    total, prefix = sum(query_lens), sum(prefix_lens)
    q, k = randn(total, heads, qk_dim, seed=1), randn(total, heads, qk_dim, seed=2)
    v = randn(total, heads, v_dim, seed=3)
    k_prefix, v_prefix = randn(prefix, heads, qk_dim, seed=4), randn(prefix, heads, v_dim, seed=5)
    starts = torch.tensor([0] + query_lens).cumsum(0).to(DEVICE, torch.int32)
    seq_lens = torch.tensor([q + p for q, p in zip(query_lens, prefix_lens)], dtype=torch.int32)
    out = mla_extend_attention(
        q, k, v, k_prefix, v_prefix, starts, seq_lens.to(DEVICE), prefix_lens,
        max(query_lens), SCALE, page=page,
    )  # fmt: skip
    expected = mla_reference.mla_extend(
        *(x.cpu() for x in (q, k, v, k_prefix, v_prefix)), query_lens, prefix_lens, SCALE
    )
    assert out.shape == (total, heads, v_dim)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("normed", [False, True])
def test_rotary_cache_write_matches_reference(dtype, interleaved, normed):
    tokens, heads, nope, rope, latent_dim, block_size = 6, 5, 6, 8, 20, 4
    q = randn(tokens, heads, nope + rope, seed=1, dtype=dtype)  # q_pe is a view of it
    kv_a = randn(tokens, latent_dim + rope, seed=2, dtype=dtype)  # k_pe too
    latent = randn(tokens, latent_dim, seed=3, dtype=dtype)
    positions = torch.tensor([0, 5, 9, 2, 7, 3], device=DEVICE)
    cos_sin = randn(16, rope, seed=4)
    slots = torch.tensor([3, 0, 17, 9, 10, 4], device=DEVICE)  # across blocks
    ref_cache = torch.zeros(6, 1, block_size, 1, latent_dim + rope, dtype=dtype, device=DEVICE)
    cache, before = ref_cache.clone(), q.clone()
    args = (q[..., nope:], kv_a[:, None, latent_dim:], latent, positions, cos_sin)
    # normed: the decode path's latent, RMS-normalised by the kernel as it is cached
    norm = (randn(latent_dim, seed=5, dtype=dtype) + 1, 1e-6) if normed else ()
    ref_q, ref_k = mla_reference.mla_rotary_cache_write(*args, ref_cache, slots, interleaved,
                                                        *norm)  # fmt: skip
    for _ in range(2):  # idempotent: a tuner may run it many times
        got_q, got_k = mla_rotary_cache_write(*args, cache, slots, interleaved, *norm)
    # The interpreter rounds float32 -> bfloat16 by truncation: a few ulps of slack.
    tol = TOLERANCE[dtype] * (3 if dtype == torch.bfloat16 else 1)
    for got, want in ((got_q, ref_q), (got_k, ref_k), (cache, ref_cache)):
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(q, before)  # the projection it reads is left as it was
    if normed:  # the cache holds what the norm kernel would have made of the latent
        want = rms_norm(latent, *norm)
        entries = cache.view(-1, latent_dim + rope)[slots, :latent_dim]
        torch.testing.assert_close(entries.float(), want.float(), atol=tol, rtol=tol)


def test_interleaved_rotary_keeps_every_score():
    """De-interleaving pairs permutes q_pe and k_pe alike: q . k is unchanged, which is why
    the cache may keep the neox layout for DeepSeek's interleaved checkpoints."""
    q, k = randn(4, 3, 8, seed=1), randn(4, 1, 8, seed=2)
    pair_q, pair_k = (x.unflatten(-1, (-1, 2)) for x in (q, k))
    angle = randn(4, 1, 4, seed=3)
    rot = torch.polar(torch.ones_like(angle), angle)

    def rotate_pairs(x):
        return torch.view_as_real(torch.view_as_complex(x.contiguous()) * rot).flatten(-2)

    expected = (rotate_pairs(pair_q) * rotate_pairs(pair_k)).sum(-1)
    cos_sin = torch.cat([angle.cos(), angle.sin()], dim=-1)[:, 0]  # one position per token
    positions = torch.arange(4, device=DEVICE)
    cache = torch.zeros(1, 1, 4, 1, 8 + 2, device=DEVICE)
    q_rot, k_rot = mla_rotary_cache_write(q, k, randn(4, 2, seed=4), positions, cos_sin, cache,
                                          positions, True)  # fmt: skip
    torch.testing.assert_close((q_rot * k_rot).sum(-1), expected, atol=1e-5, rtol=1e-5)
