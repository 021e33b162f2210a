"""Registers the Triton kernels as the CUDA implementations of `kernels.ops`.

Imported once by the engine when it runs on CUDA; on CPU the references run
(tests exercise the kernels on CPU through Triton's interpreter directly).
"""

from __future__ import annotations

from kernels import ops

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from kernels.activation import silu_and_mul
    from kernels.fused_moe import fused_moe
    from kernels.grouped_topk import grouped_topk
    from kernels.mla_rotary import mla_rotary_cache_write
    from kernels.moe_routing import moe_route
    from kernels.norm import fused_add_rms_norm, rms_norm
    from kernels.rotary import apply_rotary, rotary_cache_write
    from kernels.skinny_linear import linear

    for fn in (
        linear,
        rms_norm,
        fused_add_rms_norm,
        silu_and_mul,
        apply_rotary,
        rotary_cache_write,
        moe_route,
        grouped_topk,
        fused_moe,
        mla_rotary_cache_write,
    ):
        ops.register_cuda(fn.__name__, fn)
    _registered = True


def unregister() -> None:
    """Back to the references everywhere (the engine's `kernels="torch"` option)."""
    global _registered
    ops._CUDA_IMPLS.clear()
    _registered = False
