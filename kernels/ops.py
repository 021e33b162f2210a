"""The operators the engine calls. Each picks its implementation per call:
in mode "auto" the Triton kernel for CUDA tensors (where one is registered)
and the torch reference otherwise; mode "triton" uses the kernels for every
device (on CPU through Triton's interpreter, for tests); mode "torch" always
uses the references (to compare against them on the GPU)."""

from __future__ import annotations

import contextlib

import torch

from kernels import mla_reference, reference

MODES = ("auto", "triton", "torch")
# name -> kernel implementation; filled by kernels.cuda_ops.register().
_CUDA_IMPLS: dict[str, object] = {}
_mode = "auto"


def register_cuda(name: str, fn) -> None:
    _CUDA_IMPLS[name] = fn


@contextlib.contextmanager
def using(mode: str):
    """Runs the enclosed calls with the given implementation mode."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"kernel mode must be one of {MODES}, got {mode!r}")
    previous, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = previous


def _pick(name: str, x: torch.Tensor):
    if _mode != "torch" and (x.is_cuda or _mode == "triton") and name in _CUDA_IMPLS:
        return _CUDA_IMPLS[name]
    return getattr(reference, name, None) or getattr(mla_reference, name)


def linear(x, w, bias=None):
    return _pick("linear", x)(x, w, bias)


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


def fused_moe(x, w13, w2, topk_weights, topk_ids, load=None, shared=None):
    return _pick("fused_moe", x)(x, w13, w2, topk_weights, topk_ids, load, shared)


def grouped_topk(router_logits, top_k, num_groups, topk_group, renormalize, scaling,
                 scoring="softmax", correction_bias=None):  # fmt: skip
    return _pick("grouped_topk", router_logits)(
        router_logits, top_k, num_groups, topk_group, renormalize, scaling, scoring,
        correction_bias,
    )  # fmt: skip


def mla_rotary_cache_write(q_pe, k_pe, latent, positions, cos_sin, cache, slot_mapping,
                           interleaved, norm_weight=None, eps=0.0):  # fmt: skip
    return _pick("mla_rotary_cache_write", q_pe)(
        q_pe, k_pe, latent, positions, cos_sin, cache, slot_mapping, interleaved, norm_weight,
        eps,
    )  # fmt: skip
