"""Input checks shared by the Triton attention launchers (decode and extend).

The kernels assume a contiguous block-major cache, int32 index tensors and
stride-1 head dimensions; anything else is refused here with a ValueError
that names the argument, rather than read wrongly by the kernel.
"""

from __future__ import annotations

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def dot_precision(dtype: torch.dtype) -> str:
    # float32 (parity runs) wants near-exact products: three TF32 passes keep the tensor
    # cores, where "ieee" falls back to FMA loops that spill; 16-bit inputs ignore it.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def fit_float32(dtype: torch.dtype, block_n: int, num_stages: int) -> tuple[int, int]:
    """Tiles sized for 16-bit inputs would overflow shared memory at 4 bytes an element."""
    if dtype == torch.float32:
        return min(block_n, 32), min(num_stages, 2)
    return block_n, num_stages


def extend_tiles(q, seq_lens, max_query_len: int, block_m: int, block_n: int, num_stages: int):
    """An extend launch's grid (q head, query tile, sequence) and its tile sizes, fitted
    to float32 inputs: (grid, block_m, block_n, num_stages)."""
    block_n, num_stages = fit_float32(q.dtype, block_n, num_stages)
    if q.dtype == torch.float32:
        block_m = min(block_m, 64)
    grid = (q.shape[1], triton.cdiv(max_query_len, block_m), seq_lens.shape[0])
    return grid, block_m, block_n, num_stages


def check_device(q: torch.Tensor, kernel) -> None:
    if q.device.type != "cuda" and not isinstance(kernel, InterpretedFunction):
        raise ValueError(
            f"Triton attention needs CUDA tensors (or TRITON_INTERPRET=1), got {q.device}"
        )


def check_heads(name: str, x: torch.Tensor, q: torch.Tensor, heads: int | None) -> None:
    """x: [tokens, heads, head_dim] in q's dtype and device, head_dim contiguous."""
    if x.dim() != 3:
        raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} dtype must be one of {SUPPORTED_DTYPES}, got {x.dtype}")
    if x.dtype != q.dtype or x.device != q.device:
        raise ValueError(
            f"{name} must match q's dtype and device ({q.dtype}, {q.device}), "
            f"got {x.dtype} on {x.device}"
        )
    if heads is not None and x.shape[1] != heads:
        raise ValueError(f"{name} must have {heads} heads, got {x.shape[1]}")
    if x.shape[2] != q.shape[2]:
        raise ValueError(f"{name} head_dim {x.shape[2]} differs from q's {q.shape[2]}")
    if x.shape[2] > 0 and x.stride(2) != 1:
        raise ValueError(f"{name}'s last dimension must be contiguous (stride 1)")


def check_cache(q: torch.Tensor, cache: torch.Tensor) -> None:
    """cache: [num_blocks, 2, block_size, kv_heads, head_dim], contiguous, kv_heads | q_heads."""
    if cache.dim() != 5 or cache.shape[1] != 2:
        raise ValueError(
            "cache must be [num_blocks, 2, block_size, kv_heads, head_dim], "
            f"got shape {tuple(cache.shape)}"
        )
    if cache.dtype != q.dtype or cache.device != q.device:
        raise ValueError(
            f"cache must match q's dtype and device ({q.dtype}, {q.device}), "
            f"got {cache.dtype} on {cache.device}"
        )
    if cache.shape[4] != q.shape[2]:
        raise ValueError(f"cache head_dim {cache.shape[4]} differs from q's {q.shape[2]}")
    kv_heads = cache.shape[3]
    if kv_heads == 0 or q.shape[1] % kv_heads != 0:
        raise ValueError(
            f"q heads ({q.shape[1]}) must be a multiple of cache kv heads ({kv_heads})"
        )
    if cache.shape[2] < 1:
        raise ValueError("cache block_size must be at least 1")
    if not cache.is_contiguous():
        raise ValueError("cache must be contiguous (block-major)")


def check_index(
    name: str, x: torch.Tensor, q: torch.Tensor, shape: tuple[int, ...], rows_only: bool = False
) -> None:
    """An int32 index tensor of the given shape on q's device (contiguous, or stride-1 rows)."""
    if x.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {x.dtype}")
    if x.device != q.device:
        raise ValueError(f"{name} must be on {q.device}, got {x.device}")
    if x.dim() != len(shape) or any(s is not None and a != s for a, s in zip(x.shape, shape)):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{name} must have shape [{want}], got {tuple(x.shape)}")
    contiguous = x.stride(-1) == 1 if rows_only and x.numel() else x.is_contiguous()
    if not contiguous:
        raise ValueError(f"{name} must be contiguous")


def check_out(expected: torch.Tensor, out: torch.Tensor) -> None:
    if out.shape != expected.shape or out.dtype != expected.dtype:
        raise ValueError(
            f"out must be {expected.dtype} {tuple(expected.shape)}, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    if out.device != expected.device:
        raise ValueError(f"out must be on {expected.device}, got {out.device}")
    if out.numel() and out.stride(-1) != 1:
        raise ValueError("out's last dimension must be contiguous (stride 1)")


def check_common(
    q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    batch: int, kernel,
) -> None:  # fmt: skip
    """The checks decode and extend share, with q already known to be 3-D."""
    check_heads("q", q, q, None)
    check_cache(q, cache)
    check_device(q, kernel)
    check_index("block_tables", block_tables, q, (batch, None), rows_only=True)
    check_index("seq_lens", seq_lens, q, (batch,))
