"""Engine baseline on one GPU: the llama3-8b preset in bf16 with dummy weights.

Records decode tokens/s at batch 1 and 64, and offline throughput for 256
prompts of 1024 random tokens generating 128 each, with the ceilings of the
same run. Usage: python bench/engine_baseline.py --out DIR [--backend torch]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.ceilings import measure
from engine import LLM, SamplingParams
from engine.make_model import preset_config, write_model


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, max(vocab - 1000, vocab // 2), (n, length), generator=g).tolist()


def decode_rate(llm: LLM, batch: int, context: int, steps: int) -> dict:
    """Tokens/s of pure decode steps for `batch` sequences at about `context` tokens."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, context, vocab, seed=batch)):
        engine.add_request(f"decode-{batch}-{i}", prompt, params)
    while any(s.in_prefill for s in engine.scheduler.waiting + engine.scheduler.running):
        engine.step()
    for _ in range(3):  # warm up at this batch size
        engine.step(finished_only=True)
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step(finished_only=True)
    _sync()
    elapsed = time.perf_counter() - start
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    return {
        "batch": batch,
        "context": context,
        "steps": steps,
        "step_ms": elapsed / steps * 1e3,
        "tokens_per_s": batch * steps / elapsed,
    }


def offline_throughput(llm: LLM, num_prompts: int, input_len: int, output_len: int) -> dict:
    vocab = llm.engine.model_config.vocab_size
    prompts = random_prompts(num_prompts, input_len, vocab, seed=7)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    _sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync()
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "elapsed_s": elapsed,
        "requests_per_s": num_prompts / elapsed,
        "output_tokens_per_s": generated / elapsed,
        "total_tokens_per_s": (generated + num_prompts * input_len) / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--tag", default="baseline")
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--device", default="cuda")  # cpu: a dry run of the script itself
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    ceilings = measure() if cuda else {"copy_gbps": 1.0, "matmul_bf16_tflops": 1.0}
    folder = write_model(
        Path(tempfile.mkdtemp()) / args.preset, preset_config(args.preset), weights=False
    )
    llm = LLM(
        folder,
        dtype="bfloat16" if cuda else "float32",
        device=args.device,
        load_format="dummy",
        kernels=args.backend,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
    )
    config = llm.engine.model_config
    weight_bytes = config.num_parameters() * 2
    floor_tps = ceilings["copy_gbps"] * 1e9 / weight_bytes
    result = {
        "benchmark": "engine_baseline",
        "tag": args.tag,
        "model": f"{args.preset} (dummy)",
        "ceilings": ceilings,
        "weight_bytes": weight_bytes,
        "kv_blocks": llm.engine.runner.num_blocks,
        "batch1_bandwidth_floor_tokens_per_s": floor_tps,
        "decode": [decode_rate(llm, 1, 128, 64), decode_rate(llm, 64, 1024, 32)],
        "offline": offline_throughput(llm, args.num_prompts, 1024, 128),
    }
    (out / f"engine_{args.tag}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print("\n| measure | value |\n|---|---|")
    print(f"| copy GB/s | {ceilings['copy_gbps']:.0f} |")
    print(f"| bf16 matmul TFLOP/s | {ceilings['matmul_bf16_tflops']:.0f} |")
    for d in result["decode"]:
        print(
            f"| decode batch {d['batch']} @ {d['context']} ctx tok/s | "
            f"{d['tokens_per_s']:.1f} ({d['step_ms']:.1f} ms/step) |"
        )
    print(f"| batch-1 bandwidth floor tok/s | {floor_tps:.1f} |")
    o = result["offline"]
    print(
        f"| offline {o['num_prompts']}x{o['input_len']}->{o['output_len']} | "
        f"{o['output_tokens_per_s']:.0f} out tok/s, {o['total_tokens_per_s']:.0f} total tok/s,"
        f" {o['elapsed_s']:.1f} s |"
    )


if __name__ == "__main__":
    main()
