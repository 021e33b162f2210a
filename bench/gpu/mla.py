"""MLA (DeepSeek multi-head latent attention) on one GPU: the ceilings; the
paged MLA decode kernel against its torch reference; DeepSeek-V2-Lite decode
with dummy bf16 weights under CUDA graphs against its bandwidth floor (batch
1) and roofline (batch 64); the engine on its Triton kernels and graphs
against its torch references on the tiny DeepSeek presets.

Usage: python -m bench.gpu.mla --out FILE [--skip NAME ...] [--device cpu]
Sections: ceilings, decode_kernel, v2_lite_decode, engine/<preset>/<dtype>.
`--device cpu` is a dry run at tiny sizes (kernels through Triton's interpreter,
the tiny-deepseek-v2 preset in place of V2-Lite), to check the script runs.

Targets: the decode kernel reads the latents at >= 0.85 of the copy bandwidth
(16 heads; 128 heads are compute-bound, so their TFLOP/s are reported too);
V2-Lite batch 1 at >= 0.75 of the floor set by its active weights (attention,
dense, shared and its top-k routed experts per token); batch 64 within 1.4x
of the roofline bound.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from bench.gpu.ceilings import measure
from bench.gpu.sections import Sections, script_parser
from bench.gpu.timing import median_ms, queued_ms

LATENT, ROPE = 512, 64  # DeepSeek-V2/V3 widths
GPU = dict(kernel_cases=[(64, 4096), (8, 32768)], heads=[16, 128], block_size=16,
           v2_lite="deepseek-v2-lite", batch1=(1, 128, 64), batchN=(64, 1024, 32),
           check_lengths=(1, 17, 200, 700), check_tokens=24)  # fmt: skip
CPU = dict(kernel_cases=[(2, 40), (1, 70)], heads=[4, 16], block_size=16,
           v2_lite="tiny-deepseek-v2", batch1=(1, 8, 3), batchN=(4, 24, 3),
           check_lengths=(1, 17), check_tokens=4)  # fmt: skip
CHECKED = ("tiny-deepseek-v2", "tiny-deepseek-v3")


def case_cache(batch: int, context: int, block_size: int, dtype, device: str):
    """A paged latent cache of batch sequences of `context` tokens in scattered blocks:
    (cache, block_tables, seq_lens)."""
    blocks = -(-context // block_size)
    cache = torch.randn(batch * blocks + 1, 1, block_size, 1, LATENT + ROPE, device=device)
    tables = torch.randperm(batch * blocks, device=device).view(batch, blocks).int() + 1
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return cache.to(dtype), tables, lens


def case_queries(batch: int, heads: int, dtype, device: str):
    """(q_latent, q_pe) views of one [batch, heads, latent + rope] query."""
    q = torch.randn(batch, heads, LATENT + ROPE, device=device).to(dtype) * 0.1
    return q[..., :LATENT], q[..., LATENT:]


SCALE = (128 + 64) ** -0.5


def kernel_row(batch: int, context: int, heads: int, ms: float, element: int,
               ceilings: dict) -> dict:  # fmt: skip
    """A launch's time as bandwidth (the latents read once) and as tensor-core work."""
    latent_bytes = batch * context * (LATENT + ROPE) * element
    gbps = latent_bytes / (ms / 1e3) / 1e9
    tflops = 2 * batch * heads * context * (LATENT + ROPE + LATENT) / (ms / 1e3) / 1e12
    return {
        "batch": batch, "context": context, "heads": heads, "ms": ms, "latent_gbps": gbps,
        "fraction_of_copy_bandwidth": gbps / ceilings["copy_gbps"], "tflops": tflops,
        "fraction_of_matmul_peak": tflops / ceilings["matmul_bf16_tflops"],
    }  # fmt: skip


def decode_kernel(sizes: dict, ceilings: dict, device: str) -> list[dict]:
    """The MLA decode kernel at each (batch, context) and head count, bf16 (float32 on
    the CPU, where the interpreter's bfloat16 is not the GPU's)."""
    from kernels.mla_decode import mla_decode_attention
    from kernels.mla_reference import mla_decode

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for batch, context in sizes["kernel_cases"]:
        cache, tables, lens = case_cache(batch, context, sizes["block_size"], dtype, device)
        for heads in sizes["heads"]:
            args = (*case_queries(batch, heads, dtype, device), cache, tables, lens, SCALE)

            def kernel(args=args, context=context):
                return mla_decode_attention(*args, context)

            def reference(args=args):
                return mla_decode(*args)

            out, want = kernel().float(), reference().float()
            ms, ref_ms = queued_ms(kernel, device), median_ms(reference, device)
            row = kernel_row(batch, context, heads, ms, cache.element_size(), ceilings)
            error = ((out - want).abs().max() / want.abs().max()).item()
            row.update(reference_ms=ref_ms, speedup_vs_reference=ref_ms / ms, max_rel_error=error)
            rows.append(row)
    return rows


def step_bound_s(runner, ceilings: dict, batch: int, context: int) -> dict:
    """Roofline of one decode step: every weight the step must read (the routed experts
    some token of the batch picks, in expectation) plus the batch's latents, or the
    step's FLOPs (absorbed attention: 2 * heads * context * (2 * latent + rope) a token
    and layer), whichever takes longer."""
    config = runner.model_config
    layers, moe = config.num_hidden_layers, len(config.moe_layers)
    experts, top_k = config.num_experts, config.num_experts_per_tok
    expert = config.moe_parameters(1) - config.moe_parameters(0)
    hit = experts * (1 - (1 - top_k / experts) ** batch) if experts else 0.0
    weights = config.active_parameters() + moe * (hit - top_k) * expert
    element = torch.finfo(runner.dtype).bits // 8
    bytes_moved = element * weights + batch * context * runner.kv_spec.bytes_per_token
    width = 2 * config.kv_lora_rank + config.qk_rope_head_dim
    attention = 2 * config.num_attention_heads * context * width
    flops = batch * (2 * config.active_parameters() + layers * attention)
    memory_s = bytes_moved / (ceilings["copy_gbps"] * 1e9)
    compute_s = flops / (ceilings["matmul_bf16_tflops"] * 1e12)
    return {"bytes": bytes_moved, "flops": flops, "bound_s": max(memory_s, compute_s)}


def free_device_memory() -> None:
    """What an earlier section left (an engine a failure kept alive in a reference
    cycle, the allocator's cached blocks) goes back, so the next engine's KV cache,
    sized from free memory, fits."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def v2_lite_decode(sizes: dict, ceilings: dict, device: str, root: Path) -> dict:
    from bench.gpu.engine_rates import decode_rate
    from bench.gpu.models import preset_folder
    from engine import LLM

    free_device_memory()
    folder, load_format = preset_folder(root, sizes["v2_lite"])
    # No start-up warm-up: only decode steps are timed, and the graph capture tunes them.
    dtype = "bfloat16" if device == "cuda" else "float32"
    llm = LLM(folder, dtype=dtype, device=device, load_format=load_format, max_num_seqs=64,
              max_model_len=4096, warmup=False)  # fmt: skip
    runner = llm.engine.runner
    config = runner.model_config
    try:
        one, many = decode_rate(llm, *sizes["batch1"]), decode_rate(llm, *sizes["batchN"])
        graphs = runner.graphs is not None
        floor = step_bound_s(runner, ceilings, 1, one["context"])
        bound = step_bound_s(runner, ceilings, many["batch"], many["context"])
    finally:
        llm.close()
    one["bandwidth_floor_tokens_per_s"] = 1 / floor["bound_s"]
    one["fraction_of_bandwidth_floor"] = one["tokens_per_s"] * floor["bound_s"]
    many["roofline_step_ms"] = bound["bound_s"] * 1e3
    many["step_over_roofline"] = many["step_ms"] / (bound["bound_s"] * 1e3)
    return {
        "preset": sizes["v2_lite"],
        "cuda_graphs": graphs,
        "active_parameters": config.active_parameters(),
        "batch1": one,
        "batch_many": many,
    }


def engine_check(section: Sections, check, dtype: str) -> dict:
    """The engine on its Triton kernels (and CUDA graphs on the GPU) against the same
    engine on its torch references (bench.gpu.engine_checks.Check, one a preset, so its
    float32 reference runs once for both dtypes): prompt logits (expanded form) within
    bf16 tolerance, greedy tokens (decode: absorbed form) equal up to a near-tie; in
    float32 every greedy token equal."""
    free_device_memory()
    # in 16 bits, also both against the float32 reference: how far the kernels part from
    # it beside how far the 16-bit reference does
    result = check.kernels(dtype, against=None if dtype == "float32" else "float32")
    if dtype == "float32":
        result["passed"] = result["passed"] and all(g["equal"] for g in result["greedy"])
    return result


def main(argv: list[str] | None = None) -> dict:
    args = script_parser(__doc__).parse_args(argv)
    sizes = GPU if args.device == "cuda" else CPU
    with Sections(args, script="mla") as section:
        ceilings = section("ceilings", lambda: measure(args.device))
        if ceilings is None:
            raise SystemExit("no ceilings, nothing to compare against")
        section("decode_kernel", lambda: decode_kernel(sizes, ceilings, args.device))
        section("v2_lite_decode", lambda: v2_lite_decode(sizes, ceilings, args.device,
                                                         section.tmp))  # fmt: skip
        from bench.gpu.engine_checks import Check

        checks: dict = {}  # one a preset, made by its first section that runs

        def check_of(preset: str):
            if preset not in checks:
                checks[preset] = Check(section, preset, sizes["check_lengths"],
                                       sizes["check_tokens"])  # fmt: skip
            return checks[preset]

        for preset in CHECKED:
            for dtype in ("float32", "bfloat16"):
                section(
                    f"engine/{preset}/{dtype}",
                    lambda p=preset, d=dtype: engine_check(section, check_of(p), d),
                    # The interpreter's bf16 dots are not the GPU's: bf16 checks are GPU-only.
                    needs="bfloat16 Triton kernels" if dtype == "bfloat16" else None,
                )
        results = section.results
    print_summary(results)
    return results


def print_summary(results: dict) -> None:
    c = results.get("ceilings") or {}
    print(f"\nceilings: copy {c.get('copy_gbps', 0):.0f} GB/s, bf16 matmul "
          f"{c.get('matmul_bf16_tflops', 0):.1f} TFLOP/s")  # fmt: skip
    for row in results.get("decode_kernel") or []:
        if isinstance(row, dict) and "ms" in row:
            print(f"mla decode B={row['batch']} ctx={row['context']} H={row['heads']}: "
                  f"{row['ms']:.3f} ms, {row['fraction_of_copy_bandwidth']:.2f} of copy BW, "
                  f"{row['tflops']:.1f} TFLOP/s, {row['speedup_vs_reference']:.1f}x reference, "
                  f"rel err {row['max_rel_error']:.1e}")  # fmt: skip
    lite = results.get("v2_lite_decode") or {}
    if "batch1" in lite:
        one, many = lite["batch1"], lite["batch_many"]
        print(f"{lite['preset']} batch 1: {one['tokens_per_s']:.1f} tok/s, "
              f"{one['fraction_of_bandwidth_floor']:.2f} of the floor; batch {many['batch']} @ "
              f"{many['context']}: {many['step_ms']:.2f} ms/step, "
              f"{many['step_over_roofline']:.2f}x roofline")  # fmt: skip
    for name, entry in results.items():
        if name.startswith("engine/") and isinstance(entry, dict) and "passed" in entry:
            print(f"{name}: passed={entry['passed']} logits rel err "
                  f"{max(entry['prompt_logits_rel_error']):.1e}, logprob diff "
                  f"{entry['max_logprob_diff_before_divergence']:.1e}")  # fmt: skip
            for dtype_name, pair in (entry.get("against_float32") or {}).items():
                print(f"  {dtype_name} against the float32 reference: "
                      f"{_agreement(pair)}")  # fmt: skip


def _agreement(check: dict) -> str:
    greedy = check["greedy"]
    equal = sum(g["equal"] for g in greedy)
    ties = sum(g["near_tie"] for g in greedy)
    return (
        f"greedy equal on {equal} of {len(greedy)} prompts ({ties} more part at a "
        f"near-tie), prompt logits {max(check['prompt_logits_rel_error']):.1e} apart"
    )


if __name__ == "__main__":
    main()
