"""Triton SiLU-and-mul: SiLU(gate) * up on the fused [..., 2W] gate/up projection.

A pure streaming kernel: each program reads one BLOCK_W stretch of a row's gate
and the matching stretch of its up half and writes BLOCK_W outputs. Rounding
follows `kernels.reference` (SiLU rounded to the input dtype before the
multiply, as `F.silu(gate) * up` does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.selection import Selector, next_power_of_2

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _silu_and_mul_kernel(
    gu_ptr, out_ptr, W, stride_row, BLOCK_W: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = cols < W
    gate_ptrs = gu_ptr + row * stride_row + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0)
    up = tl.load(gate_ptrs + W, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * W + cols, (silu * up).to(gate.dtype), mask=mask)


def _launch(gate_up: torch.Tensor, *, block_w: int, num_warps: int) -> torch.Tensor:
    width = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], width, dtype=gate_up.dtype, device=gate_up.device)
    rows = out.numel() // max(1, width)
    if rows == 0 or width == 0:
        return out
    # Leading dims that merge into one row stride are used in place; others are copied.
    if gate_up.dim() == 1:
        gu2 = gate_up.view(1, -1)
    elif gate_up.dim() == 2:
        gu2 = gate_up
    else:
        gu2 = gate_up.reshape(rows, 2 * width)
    block = min(block_w, next_power_of_2(width))
    _silu_and_mul_kernel[(rows, triton.cdiv(width, block))](
        gu2, out, width, gu2.stride(0), BLOCK_W=block, num_warps=num_warps
    )
    return out


_CONFIGS = [
    {"block_w": 1024, "num_warps": 4},
    {"block_w": 2048, "num_warps": 4},
    {"block_w": 2048, "num_warps": 8},
    {"block_w": 4096, "num_warps": 8},
    {"block_w": 512, "num_warps": 2},
]


def _bucket(gate_up):
    width = gate_up.shape[-1] // 2
    rows = gate_up.numel() // max(1, gate_up.shape[-1])
    return (min(next_power_of_2(rows), 1 << 16), width, str(gate_up.dtype))


_selector = Selector("silu_and_mul", {"rowwise": _launch}, {"rowwise": _CONFIGS}, _bucket)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up on [..., 2W] -> [..., W] in the input dtype."""
    if gate_up.dtype not in FLOAT_DTYPES:
        raise ValueError(f"silu_and_mul supports {FLOAT_DTYPES}, got {gate_up.dtype}")
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"last dimension must be even (gate then up), got {tuple(gate_up.shape)}")
    if gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up must have unit stride in its last dim, got {gate_up.stride()}")
    return _selector(gate_up)
