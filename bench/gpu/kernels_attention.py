"""Decode attention for the kernels benchmark (bf16, Llama-3-8B heads: 32 q / 8 kv, dim
128), and the torch SDPA backends it and prefill attention are compared with.

Split-KV paged decode attention at batch 64 x 4096 and batch 8 x 32768 tokens of
context, reported as GB/s of K/V + q + out (+ block tables) against the copy ceiling
(target 75%). The kernel is first checked against the torch reference on the same
inputs. Its headline time is a CUDA graph's replay (the engine runs decode in graphs);
the "vs" columns compare eager launches, and SDPA gets the batch's K/V already gathered
into contiguous tensors (the gather untimed), native GQA where the backend takes it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from bench.gpu.timing import flushed_ms, graph_ms
from kernels.attention_reference import paged_attention
from kernels.decode_attention import decode_attention

SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


@dataclasses.dataclass(frozen=True)
class AttentionShapes:
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    decode_cases: tuple[tuple[int, int], ...] = ((64, 4096), (8, 32768))  # (batch, context)
    prefill_tokens: int = 8192
    dtype: torch.dtype = torch.bfloat16

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        heads = f"q_heads={self.q_heads} kv_heads={self.kv_heads} head_dim={self.head_dim}"
        return f"{heads} block_size={self.block_size} {dtype}"


GPU = AttentionShapes()  # each decode case reads 1.07 GB of K/V, far beyond L2
DRY = AttentionShapes(q_heads=4, kv_heads=2, head_dim=32, decode_cases=((2, 40),),
                      prefill_tokens=48)  # fmt: skip


def max_rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def random_cache(shapes: AttentionShapes, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    size = (num_blocks, 2, shapes.block_size, shapes.kv_heads, shapes.head_dim)
    return torch.randn(size, generator=gen, device=gen.device, dtype=shapes.dtype)


def bench_decode(shapes: AttentionShapes, batch: int, context: int, copy_gbps: float,
                 gen: torch.Generator) -> dict:  # fmt: skip
    device = gen.device
    pages = -(-context // shapes.block_size)
    # A pool a quarter larger than the batch needs, its blocks handed out in random order
    # the way a long-running block pool ends up.
    num_blocks = batch * pages * 5 // 4
    cache = random_cache(shapes, num_blocks, gen)
    order = torch.randperm(num_blocks, generator=gen, device=device)
    block_tables = order[: batch * pages].view(batch, pages).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, shapes.q_heads, shapes.head_dim, generator=gen, device=device,
                    dtype=shapes.dtype)  # fmt: skip
    out = torch.empty_like(q)
    scale = shapes.scale

    def kernel():
        return decode_attention(q, cache, block_tables, seq_lens, scale, context, out=out)

    def reference():
        return paged_attention(q, cache, block_tables, [1] * batch, [context] * batch, scale)

    kernel()  # tunes the launch config for this bucket on first use
    ref = reference()
    error = max_rel_error(kernel(), ref)
    del ref
    graph = graph_ms(kernel, device)
    eager_ms = flushed_ms(kernel, device)
    ref_ms = flushed_ms(reference, device)
    sdpa_ms = decode_sdpa_times(shapes, q, cache, block_tables, context)
    fastest_sdpa = min(sdpa_ms.values()) if sdpa_ms else None
    kv_bytes = batch * context * shapes.kv_heads * shapes.head_dim * 2 * cache.element_size()
    io_bytes = 2 * q.numel() * q.element_size() + block_tables.numel() * 4
    ms = graph if graph is not None else eager_ms
    gbps = (kv_bytes + io_bytes) / (ms / 1e3) / 1e9
    return {
        "op": "decode_attention",
        "shape": f"batch={batch} context={context} {shapes.describe()}",
        "ms": ms,
        "timed_as": "cuda graph" if graph is not None else "eager",
        "eager_ms": eager_ms,
        "metric": "GB/s",
        "achieved": gbps,
        "fraction_of_ceiling": gbps / copy_gbps,
        "target": 0.75,
        "speedup_vs_reference": ref_ms / eager_ms,
        "speedup_vs_sdpa": fastest_sdpa / eager_ms if fastest_sdpa else None,
        "sdpa_ms": sdpa_ms,
        "max_rel_error": error,
    }


def sdpa_ms(backend_name: str, qh, kh, vh, causal: bool, scale: float) -> float | None:
    """Median ms of SDPA on one backend ([B, H, L, D] inputs; fewer k/v heads than q
    heads run as GQA), or None when this build, device or shape lacks it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    gqa = kh.shape[1] != qh.shape[1]

    def sdpa():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(
                qh, kh, vh, is_causal=causal, scale=scale, enable_gqa=gqa
            )

    try:
        sdpa()
        if qh.is_cuda:
            torch.cuda.synchronize()
    except RuntimeError:
        return None
    return flushed_ms(sdpa, qh.device)


def prefill_sdpa_times(shapes: AttentionShapes, q, k, v) -> dict[str, float]:
    """Median ms of causal SDPA per backend on contiguous [1, Hq, T, D], GQA expanded."""
    group = shapes.q_heads // shapes.kv_heads
    qh = q.transpose(0, 1).unsqueeze(0).contiguous()
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0).contiguous()
    vh = v.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0).contiguous()
    times = {name: sdpa_ms(name, qh, kh, vh, True, shapes.scale) for name in SDPA_BACKENDS}
    return {name: ms for name, ms in times.items() if ms is not None}


def decode_sdpa_times(shapes: AttentionShapes, q, cache, block_tables, context: int) -> dict:
    """Median ms of SDPA per backend on the batch's K/V already gathered into contiguous
    [B, Hkv, L, D] (the gather is not timed): native GQA where a backend takes it, else
    ("<backend> expanded") K/V repeated to the q heads."""
    batch, kv_heads, head_dim = q.shape[0], shapes.kv_heads, shapes.head_dim
    kv = cache[block_tables.long()]  # [B, pages, 2, block, Hkv, D]
    k = kv[:, :, 0].reshape(batch, -1, kv_heads, head_dim)[:, :context].transpose(1, 2)
    v = kv[:, :, 1].reshape(batch, -1, kv_heads, head_dim)[:, :context].transpose(1, 2)
    del kv
    qh, kh, vh = q.unsqueeze(2), k.contiguous(), v.contiguous()
    times, expanded = {}, None
    for name in SDPA_BACKENDS:
        ms = sdpa_ms(name, qh, kh, vh, False, shapes.scale)
        if ms is None:
            if expanded is None:
                group = shapes.q_heads // kv_heads
                expanded = tuple(x.repeat_interleave(group, dim=1) for x in (kh, vh))
            ms = sdpa_ms(name, qh, *expanded, False, shapes.scale)
            name = f"{name} expanded"
        if ms is not None:
            times[name] = ms
    return times


def run_decode(shapes: AttentionShapes, copy_gbps: float, device: str) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for batch, context in shapes.decode_cases:
        rows.append(bench_decode(shapes, batch, context, copy_gbps, gen))
        if device == "cuda":
            torch.cuda.empty_cache()  # each case's ~1.3 GB pool goes before the next
    return rows
