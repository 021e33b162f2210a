"""The few-row projection kernels (kernels/skinny_linear.py) against torch at odd shapes,
every config, through Triton's interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.skinny_linear import DOT_CONFIGS, FMA_CONFIGS, skinny_dot, skinny_fma

CASES = [(1, 37, 70), (3, 20, 130), (4, 9, 33)]  # rows, N, K
DTYPES = [torch.float32, torch.float16]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def on_device():
    """Tensors the tests make land on DEVICE (random ones drawn on the CPU, then moved)."""
    torch.set_default_device(DEVICE)
    yield
    torch.set_default_device("cpu")


def inputs(rows, n, k, dtype, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(rows, k, generator=gen, device="cpu").to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen, device="cpu") / k**0.5).to(DEVICE, dtype)
    return x, w, (x.float() @ w.float().T)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k", CASES)
def test_skinny_kernels_match_torch(rows, n, k, dtype):
    x, w, want = inputs(rows, n, k, dtype, seed=rows * n)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for fn, configs in ((skinny_fma, FMA_CONFIGS[::5]), (skinny_dot, DOT_CONFIGS[::4])):
        for cfg in configs:
            out = torch.full((rows, n), float("nan"), dtype=dtype)
            got = fn(x, w, out, **cfg)
            assert got is out
            assert torch.allclose(got.float(), want, atol=tol, rtol=tol), (fn.__name__, cfg)


def test_skinny_kernels_write_a_float32_output_and_strided_rows():
    x, w, want = inputs(2, 21, 40, torch.float32, seed=1)
    wide = torch.zeros(2, 50)
    out = wide[:, 3:24]  # rows 50 apart
    skinny_fma(x, w, out, **FMA_CONFIGS[0])
    assert torch.allclose(out, want, atol=1e-5) and not wide[:, :3].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_rows_against_a_float32_weight(dtype):
    # A router kept in float32 takes the model's 16-bit hidden states with no cast of its own.
    x, w, _ = inputs(3, 24, 70, torch.float32, seed=4)
    x = x.to(dtype)
    want = x.float() @ w.T
    for fn, cfg in ((skinny_fma, FMA_CONFIGS[1]), (skinny_dot, DOT_CONFIGS[0])):
        out = torch.empty(3, 24)
        assert torch.allclose(fn(x, w, out, **cfg), want, atol=1e-5), fn.__name__
    assert torch.allclose(reference.linear(x, w), want, atol=1e-5)
    assert reference.linear(x, w).dtype == torch.float32


def test_bad_inputs_raise_value_error():
    x, w, _ = inputs(2, 8, 16, torch.float32, seed=2)
    cfg = FMA_CONFIGS[0]
    bad = [
        lambda: skinny_fma(torch.zeros(5, 16), w, torch.zeros(5, 8), **cfg),
        lambda: skinny_dot(torch.zeros(17, 16), w, torch.zeros(17, 8), **cfg),
        lambda: skinny_fma(x, w[:, :15], torch.zeros(2, 8), **cfg),
        lambda: skinny_fma(x, w, torch.zeros(2, 7), **cfg),
        lambda: skinny_fma(x, w.half(), torch.zeros(2, 8), **cfg),
        lambda: skinny_fma(x, w.t().contiguous().t(), torch.zeros(2, 8), **cfg),
    ]
    for call in bad:
        with pytest.raises(ValueError):
            call()
