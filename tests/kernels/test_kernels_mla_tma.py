"""The TMA variant of the paged MLA decode (kernels/mla_decode_tma.py) against the torch
reference, through Triton's interpreter off CUDA: two head blocks, pages of 16 and 32,
a one-token sequence, a page boundary and one past it, padding rows, splits, and stale
NaNs in the free slots of a sequence's last page."""

from __future__ import annotations

import pytest
import torch
from test_kernels_mla import SCALE, TOLERANCE, decode_inputs, reference_decode

from kernels.mla_decode import tma_or_pointer
from kernels.mla_decode_tma import tma_device_ok, tma_inputs_ok, tma_mla_decode

CONFIG = dict(block_h=16, num_warps=4, num_stages=2, programs_per_sm=1)
SEQ_LENS = [1, 16, 17, 37, 0]  # the last row is padding


def run(inputs, num_splits, launcher=tma_mla_decode, **extra):
    q_latent = inputs[0]
    out = torch.full(q_latent.shape, float("nan"), dtype=q_latent.dtype, device=q_latent.device)
    launcher(*inputs, SCALE, max(SEQ_LENS), out, **CONFIG, num_splits=num_splits, **extra)
    return out.float().cpu()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,latent_dim,rope_dim,page", [(4, 32, 16, 16), (20, 64, 16, 32)])
def test_tma_decode_matches_reference(dtype, heads, latent_dim, rope_dim, page):
    inputs = decode_inputs(SEQ_LENS, heads, latent_dim, rope_dim, page, dtype)
    assert tma_inputs_ok(*inputs[:3])
    expected = reference_decode(*inputs)
    tol = TOLERANCE[dtype]
    for num_splits in (1, 3):  # 3 splits leave some past the end of the short sequences
        out = run(inputs, num_splits)
        torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # padding: zeros, not NaN


def test_stale_nans_in_free_slots_do_not_reach_the_output():
    inputs = decode_inputs(SEQ_LENS, 4, 32, 16, 16, torch.float16, seed=3)
    q_latent, q_pe, cache, tables, lens = inputs
    # every slot no sequence has written holds NaN, as a freed block may
    written = torch.zeros(cache.shape[0], cache.shape[2], dtype=torch.bool)
    for row, length in enumerate(lens.tolist()):
        for token in range(length):
            written[tables[row, token // 16], token % 16] = True
    cache[:, 0, :, 0][~written.to(cache.device)] = float("nan")
    out = run(inputs, 2)
    assert torch.isfinite(out).all()
    clean = cache.nan_to_num(0.0)
    expected = reference_decode(q_latent, q_pe, clean, tables, lens)
    torch.testing.assert_close(out, expected, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize(
    "heads,latent_dim,rope_dim,page,dtype",
    [(4, 48, 16, 16, torch.float16), (4, 32, 16, 5, torch.float16),
     (4, 32, 16, 16, torch.float32)],  # fmt: skip
)
def test_shapes_the_boxes_cannot_take_use_the_pointer_kernel(
    heads, latent_dim, rope_dim, page, dtype
):
    inputs = decode_inputs(SEQ_LENS, heads, latent_dim, rope_dim, page, dtype)
    assert not tma_inputs_ok(*inputs[:3])
    with pytest.raises(ValueError, match="cannot read this cache layout"):
        run(inputs, 1)
    out = run(inputs, None, launcher=tma_or_pointer)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, reference_decode(*inputs), atol=tol, rtol=tol)


def test_tma_is_offered_only_on_hopper_or_newer():
    assert not tma_device_ok(torch.device("cpu"))
    if torch.cuda.is_available():
        major, _ = torch.cuda.get_device_capability()
        assert tma_device_ok(torch.device("cuda")) == (major >= 9)
