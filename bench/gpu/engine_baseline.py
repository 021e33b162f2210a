"""Engine baseline on one GPU: the llama3-8b preset in bf16 with dummy weights.

Records decode tokens/s at batch 1 and 64, and offline throughput for 256
prompts of 1024 random tokens generating 128 each, with the ceilings of the
same run. `kernels_bench` compares its end-to-end figures with this result.

Usage: python -m bench.gpu.engine_baseline --out bench/results/engine_baseline.json
           [--kernels torch] [--preset NAME] [--num-prompts N] [--device cpu]
"""

from __future__ import annotations

import dataclasses

from bench.gpu import ceilings
from bench.gpu.engine_rates import decode_rate, offline_throughput
from bench.gpu.models import preset_folder
from bench.gpu.sections import Sections, script_parser
from engine import LLM


@dataclasses.dataclass(frozen=True)
class Sizes:
    preset: str
    decode: tuple[tuple[int, int, int], ...]  # (batch, context, steps)
    offline: tuple[int, int, int]  # (prompts, input tokens, output tokens)


GPU = Sizes("llama3-8b", ((1, 128, 64), (64, 1024, 32)), (256, 1024, 128))
DRY = Sizes("tiny-llama", ((1, 16, 4), (4, 32, 4)), (4, 32, 8))


def make_engine(section: Sections, preset: str, kernels: str) -> LLM:
    folder, load_format = preset_folder(section.tmp, preset)
    return LLM(
        folder,
        dtype="bfloat16" if section.cuda else "float32",
        device=section.device,
        load_format=load_format,
        kernels=kernels,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
    )


def model_figures(llm: LLM, ceiling: dict) -> dict:
    weight_bytes = llm.engine.model_config.num_parameters() * 2
    return {
        "weight_bytes": weight_bytes,
        "kv_blocks": llm.engine.facts.num_kv_blocks,
        "batch1_bandwidth_floor_tokens_per_s": ceiling["copy_gbps"] * 1e9 / weight_bytes,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--kernels", default=None, help="auto | triton | torch")
    parser.add_argument("--preset")
    parser.add_argument("--num-prompts", type=int)
    args = parser.parse_args(argv)
    sizes = GPU if args.device == "cuda" else DRY
    sizes = dataclasses.replace(
        sizes,
        preset=args.preset or sizes.preset,
        offline=(args.num_prompts or sizes.offline[0], *sizes.offline[1:]),
    )
    kernels = args.kernels or ("auto" if args.device == "cuda" else "torch")
    header = dict(script="engine_baseline", model=sizes.preset, kernels=kernels)
    with Sections(args, **header) as section:
        ceiling = section("ceilings", lambda: ceilings.measure(section.device))
        llm = section.resource(lambda: make_engine(section, sizes.preset, kernels), LLM.close)
        section("model", lambda: model_figures(llm(), ceiling))
        section("decode", lambda: [decode_rate(llm(), *case) for case in sizes.decode])
        section("offline", lambda: offline_throughput(llm(), *sizes.offline))
        print_table(section.results)
        return section.results


def print_table(results: dict) -> None:
    print("\n| measure | value |\n|---|---|")
    c = results.get("ceilings") or {}
    if "copy_gbps" in c:
        print(f"| copy GB/s | {c['copy_gbps']:.0f} |")
        print(f"| bf16 matmul TFLOP/s | {c['matmul_bf16_tflops']:.0f} |")
    for d in results.get("decode") if isinstance(results.get("decode"), list) else []:
        print(
            f"| decode batch {d['batch']} @ {d['context']} ctx tok/s | "
            f"{d['tokens_per_s']:.1f} ({d['step_ms']:.1f} ms/step) |"
        )
    floor = (results.get("model") or {}).get("batch1_bandwidth_floor_tokens_per_s")
    if floor is not None:
        print(f"| batch-1 bandwidth floor tok/s | {floor:.1f} |")
    o = results.get("offline") or {}
    if "elapsed_s" in o:
        print(
            f"| offline {o['num_prompts']}x{o['input_len']}->{o['output_len']} | "
            f"{o['output_tokens_per_s']:.0f} out tok/s, {o['total_tokens_per_s']:.0f} total "
            f"tok/s, {o['elapsed_s']:.1f} s |"
        )


if __name__ == "__main__":
    main()
