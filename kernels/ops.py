"""The operators the engine calls. Each picks its implementation once per
call from the tensor's device: Triton kernels on CUDA where one is
registered, the torch reference everywhere else."""

from __future__ import annotations

import torch

from kernels import reference

# name -> CUDA implementation; filled by kernels.triton_ops when Triton is usable.
_CUDA_IMPLS: dict[str, object] = {}


def register_cuda(name: str, fn) -> None:
    _CUDA_IMPLS[name] = fn


def _pick(name: str, x: torch.Tensor):
    if x.is_cuda and name in _CUDA_IMPLS:
        return _CUDA_IMPLS[name]
    return getattr(reference, name)


def rms_norm(x, weight, eps):
    return _pick("rms_norm", x)(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    return _pick("fused_add_rms_norm", x)(x, residual, weight, eps)


def silu_and_mul(gate_up):
    return _pick("silu_and_mul", gate_up)(gate_up)


def apply_rotary(q, k, positions, cos_sin):
    return _pick("apply_rotary", q)(q, k, positions, cos_sin)


def rotary_cache_write(q, k, v, positions, cos_sin, cache, slot_mapping):
    return _pick("rotary_cache_write", q)(q, k, v, positions, cos_sin, cache, slot_mapping)


def moe_route(router_logits, top_k, renormalize):
    return _pick("moe_route", router_logits)(router_logits, top_k, renormalize)


def fused_moe(x, w13, w2, topk_weights, topk_ids):
    return _pick("fused_moe", x)(x, w13, w2, topk_weights, topk_ids)
