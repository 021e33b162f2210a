"""Attention kernel benchmarks on one GPU (bf16, Llama-3-8B heads: 32 q / 8 kv, dim 128).

Decode: split-KV paged attention at batch 64 x 4096 and batch 8 x 32768 tokens of
context, reported as GB/s of K/V + q + out (+ block tables) against the copy ceiling
(target 75%). Prefill: one causal 8192-token sequence, reported as TFLOP/s against
the bf16 matmul ceiling (target 50%) and against torch SDPA's backends on contiguous,
GQA-expanded tensors (target 0.9x the fastest). Each kernel is first checked against
the torch reference on the same inputs. Prefill also times every extend variant on its
own (its best config, forced), checks each against the reference and against the
pointer kernel (the tuner's own check), and names the variant the Selector chose.

Usage: `run(bench.ceilings.measure())`, or standalone, printing JSON:
`python -m bench.kernels_attention [--prefill-only] [--tokens N] [--out FILE]`.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

from kernels.attention_reference import paged_attention
from kernels.decode_attention import decode_attention
from kernels.extend_attention import SELECTOR as EXTEND_SELECTOR
from kernels.extend_attention import extend_attention

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
SCALE = HEAD_DIM**-0.5
DECODE_CASES = [(64, 4096), (8, 32768)]  # (batch, context): 1.07 GB of K/V each
PREFILL_TOKENS = 8192
DEVICE = "cuda"  # the prefill part's device (a CPU smoke run may change it)


def _median_ms(fn) -> float:
    # do_bench flushes L2 before every timed call.
    return do_bench(fn, warmup=10, rep=100, return_mode="median")


def _max_rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def _random_cache(num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    shape = (num_blocks, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=gen, device=gen.device, dtype=DTYPE)


def bench_decode(batch: int, context: int, copy_gbps: float, gen: torch.Generator) -> dict:
    pages = -(-context // BLOCK_SIZE)
    # A pool a quarter larger than the batch needs, its blocks handed out in random order
    # the way a long-running block pool ends up: the data is ~1 GB, far beyond L2.
    num_blocks = batch * pages * 5 // 4
    cache = _random_cache(num_blocks, gen)
    order = torch.randperm(num_blocks, generator=gen, device="cuda")
    block_tables = order[: batch * pages].view(batch, pages).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)

    def kernel():
        return decode_attention(q, cache, block_tables, seq_lens, SCALE, context, out=out)

    def reference():
        return paged_attention(q, cache, block_tables, [1] * batch, [context] * batch, SCALE)

    kernel()  # tunes the launch config for this bucket on first use
    ref = reference()
    error = _max_rel_error(kernel(), ref)
    del ref
    # Decode runs inside CUDA graphs in the engine, so the headline time is the graph's
    # (no launch overhead); the eager time is the fair comparison with the reference.
    graph_ms = do_bench_cudagraph(kernel, rep=50, return_mode="median")
    eager_ms = _median_ms(kernel)
    ref_ms = _median_ms(reference)
    sdpa_ms = _decode_sdpa_times(q, cache, block_tables, context)
    fastest_sdpa = min(sdpa_ms.values()) if sdpa_ms else None
    kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * cache.element_size()
    io_bytes = 2 * q.numel() * q.element_size() + block_tables.numel() * 4
    gbps = (kv_bytes + io_bytes) / (graph_ms / 1e3) / 1e9
    return {
        "op": "decode_attention",
        "shape": f"batch={batch} context={context} q_heads={Q_HEADS} kv_heads={KV_HEADS} "
        f"head_dim={HEAD_DIM} block_size={BLOCK_SIZE} bf16",
        "ms": graph_ms,
        "eager_ms": eager_ms,
        "metric": "GB/s",
        "achieved": gbps,
        "fraction_of_ceiling": gbps / copy_gbps,
        "target": 0.75,
        "speedup_vs_reference": ref_ms / eager_ms,
        # Eager against eager; SDPA reads K/V already contiguous, its gather untimed.
        "speedup_vs_sdpa": fastest_sdpa / eager_ms if fastest_sdpa else None,
        "sdpa_ms": sdpa_ms,
        "max_rel_error": error,
    }


SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


def _sdpa_ms(backend_name: str, qh, kh, vh, causal: bool) -> float | None:
    """Median ms of SDPA on one backend ([B, H, L, D] inputs; fewer k/v heads than q
    heads run as GQA), or None when this build, GPU or shape lacks it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    gqa = kh.shape[1] != qh.shape[1]

    def sdpa():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(
                qh, kh, vh, is_causal=causal, scale=SCALE, enable_gqa=gqa
            )

    try:
        sdpa()
        torch.cuda.synchronize()
    except RuntimeError:
        return None
    return _median_ms(sdpa)


def _sdpa_times(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, float]:
    """Median ms of causal SDPA per backend on contiguous [1, Hq, T, D], GQA expanded."""
    group = Q_HEADS // KV_HEADS
    qh = q.transpose(0, 1).unsqueeze(0).contiguous()
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0).contiguous()
    vh = v.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0).contiguous()
    times = {name: _sdpa_ms(name, qh, kh, vh, causal=True) for name in SDPA_BACKENDS}
    return {name: ms for name, ms in times.items() if ms is not None}


def _decode_sdpa_times(q, cache, block_tables, context: int) -> dict[str, float]:
    """Median ms of SDPA per backend on the batch's K/V already gathered into contiguous
    [B, Hkv, L, D] (the gather is not timed): native GQA where a backend takes it, else
    ("<backend> expanded") K/V repeated to the q heads."""
    batch = q.shape[0]
    kv = cache[block_tables.long()]  # [B, pages, 2, block, Hkv, D]
    k = kv[:, :, 0].reshape(batch, -1, KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2)
    v = kv[:, :, 1].reshape(batch, -1, KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2)
    del kv
    qh, kh, vh = q.unsqueeze(2), k.contiguous(), v.contiguous()
    times, expanded = {}, None
    for name in SDPA_BACKENDS:
        ms = _sdpa_ms(name, qh, kh, vh, causal=False)
        if ms is None:
            if expanded is None:
                group = Q_HEADS // KV_HEADS
                expanded = tuple(x.repeat_interleave(group, dim=1) for x in (kh, vh))
            ms = _sdpa_ms(name, qh, *expanded, causal=False)
            name = f"{name} expanded"
        if ms is not None:
            times[name] = ms
    return times


def _prefill_inputs(tokens: int, gen: torch.Generator) -> tuple:
    """extend_attention's arguments for one causal prompt of `tokens` tokens."""
    q = torch.randn(tokens, Q_HEADS, HEAD_DIM, generator=gen, device=DEVICE, dtype=DTYPE)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen, device=DEVICE, dtype=DTYPE)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen, device=DEVICE, dtype=DTYPE)
    # The new keys and values are in the cache too (the reference reads them from there).
    pages = tokens // BLOCK_SIZE
    cache = _random_cache(2 * pages, gen)
    blocks = torch.randperm(2 * pages, generator=gen, device=DEVICE)[:pages]
    cache[blocks, 0] = k.view(pages, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    cache[blocks, 1] = v.view(pages, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    block_tables = blocks.view(1, pages).to(torch.int32)
    query_start_loc = torch.tensor([0, tokens], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    return q, k, v, cache, block_tables, query_start_loc, seq_lens, tokens, SCALE, out


def _prefill_reference(args: tuple) -> torch.Tensor:
    q, cache, block_tables, tokens = args[0], args[3], args[4], args[7]
    return paged_attention(q, cache, block_tables, [tokens], [tokens], SCALE)


def _prefill_tflops(tokens: int, ms: float) -> float:
    flops = 4 * tokens**2 * Q_HEADS * HEAD_DIM / 2  # causal: half of QK^T and PV
    return flops / (ms / 1e3) / 1e12


def bench_extend_variant(variant: str, args: tuple, ref: torch.Tensor, pointer_out=None) -> dict:
    """One extend variant forced: its configs tuned here (each one's ms, or why it was
    dropped), then its best timed like the selected kernel and checked."""
    usable = EXTEND_SELECTOR.usable(args[0].device)
    candidates = [c for c in usable if c.variant == variant]
    if not candidates:
        return {"offered": False}
    report: dict = {}
    try:
        best, tune_ms = EXTEND_SELECTOR.tune(args, candidates, report)
    except RuntimeError as exc:
        return {"error": str(exc), "configs": _configs_json(report)}

    def kernel():
        return EXTEND_SELECTOR.variants[variant](*args, **best.kwargs)

    try:
        out = kernel().clone()
        ms = _median_ms(kernel)
    except Exception as exc:  # report it, and let the other variants run
        return {"error": f"{type(exc).__name__}: {exc}", "config": best.kwargs}
    error = _max_rel_error(out, ref)
    row = {
        "config": best.kwargs,
        "ms": ms,
        "tflops": _prefill_tflops(args[7], ms),
        "tune_ms": tune_ms,  # the tuner's median (no L2 flush)
        "max_rel_error": error,
        "matches_reference": error < 2e-2,
        "configs": _configs_json(report),
    }
    if pointer_out is not None:  # what the tuner's check says of this output
        row["tuner_check_vs_pointer"] = EXTEND_SELECTOR.verify(pointer_out, out) or "ok"
    return row


def _configs_json(report: dict) -> list:
    return [{"config": c.kwargs, "result": r} for c, r in report.items()]


def bench_prefill(tokens: int, matmul_tflops: float, gen: torch.Generator) -> dict:
    args = _prefill_inputs(tokens, gen)

    def kernel():
        return extend_attention(*args[:9], out=args[9])

    kernel()  # tunes the launch config for this bucket on first use
    selected = EXTEND_SELECTOR.choose(*args)
    ref = _prefill_reference(args)
    error = _max_rel_error(kernel(), ref)
    ms = _median_ms(kernel)
    ref_ms = _median_ms(lambda: _prefill_reference(args))
    sdpa_ms = _sdpa_times(*args[:3])
    tflops = _prefill_tflops(tokens, ms)
    fastest_sdpa = min(sdpa_ms.values()) if sdpa_ms else None

    pointer = EXTEND_SELECTOR.variants["flash"](*args, **EXTEND_SELECTOR.candidates[0].kwargs)
    pointer = pointer.clone()
    variants = {}
    for variant in EXTEND_SELECTOR.variants:
        row = bench_extend_variant(variant, args, ref, pointer)
        if row.get("ms") and fastest_sdpa:
            row["speedup_vs_sdpa"] = fastest_sdpa / row["ms"]
        variants[variant] = row
        torch.cuda.empty_cache()
    return {
        "op": "extend_attention (causal prefill)",
        "shape": f"tokens={tokens} q_heads={Q_HEADS} kv_heads={KV_HEADS} head_dim={HEAD_DIM} bf16",
        "ms": ms,
        "metric": "TFLOP/s",
        "achieved": tflops,
        "fraction_of_ceiling": tflops / matmul_tflops,
        "target": 0.5,
        "speedup_vs_reference": ref_ms / ms,
        "speedup_vs_sdpa": fastest_sdpa / ms if fastest_sdpa else None,
        "sdpa_ms": sdpa_ms,
        "speedup_vs_sdpa_target": 0.9,
        "max_rel_error": error,
        "selected": {"variant": selected.variant, "config": selected.kwargs},
        "variants": variants,
    }


def run(ceilings: dict, decode: bool = True, tokens: int = PREFILL_TOKENS) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch, context in DECODE_CASES if decode else []:
        rows.append(bench_decode(batch, context, ceilings["copy_gbps"], gen))
        torch.cuda.empty_cache()  # each case's ~1.3 GB pool goes before the next
    rows.append(bench_prefill(tokens, ceilings["matmul_bf16_tflops"], gen))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill-only", action="store_true", help="skip the decode cases")
    parser.add_argument("--tokens", type=int, default=PREFILL_TOKENS, help="prefill length")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    from bench.ceilings import measure

    ceilings = measure()
    rows = run(ceilings, decode=not args.prefill_only, tokens=args.tokens)
    text = json.dumps({"ceilings": ceilings, "rows": rows}, indent=2, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
