"""Every extend-attention candidate, forced, on the engine's shapes, checked on the GPU.

The tuner checks each candidate's output against the pointer kernel's, but a candidate
that faults the GPU takes the process with it. This sweep runs each candidate in its own
process (CUDA_LAUNCH_BLOCKING=1, so a fault names its launch) over float32 and bfloat16,
the tiny presets' head shapes and Llama-3-8B's, a mixed batch (cached prefixes, one-token
prompts, last tiles straddling a sequence's end) with k and v as views of a fused qkv
projection, as the engine passes them; each result is compared with the torch reference.

Usage: python -m bench.gpu.extend_candidates --out bench/results/extend_candidates.json
One section, "candidates"; prints a table last. The dry run (`--device cpu`) checks the
first candidate the CPU runs (Triton's interpreter) on a small batch, in its own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from bench.gpu.sections import Sections, script_parser

BLOCK_SIZE = 16
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
# (kv heads, query heads per kv head, head dim): tiny-llama, tiny-qwen3, llama3-8b.
SHAPES = {"cuda": [(2, 2, 16), (1, 4, 32), (8, 4, 128)], "cpu": [(2, 2, 16)]}
BATCHES = {  # name -> (query lengths, sequence lengths)
    "cuda": {
        "mixed": ([40, 3, 1, 19, 70, 130], [40, 36, 70, 51, 70, 300]),
        "long": ([1000], [1000]),
    },
    "cpu": {"mixed": ([17, 1, 5], [17, 20, 40])},
}
DTYPES = {"cuda": (torch.float32, torch.bfloat16), "cpu": (torch.float32, torch.bfloat16)}


def _inputs(device, query_lens, seq_lens, kv_heads, group, head_dim, dtype, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = 2 * sum(pages) + 3
    cache = torch.randn(num_blocks, 2, BLOCK_SIZE, kv_heads, head_dim, generator=gen,
                        device=device, dtype=dtype)  # fmt: skip
    order = torch.randperm(num_blocks, generator=gen, device=device)
    block_tables = torch.zeros(len(seq_lens), max(pages) + 1, dtype=torch.int32, device=device)
    used = 0
    for i, count in enumerate(pages):
        block_tables[i, :count] = order[used : used + count].to(torch.int32)
        used += count
    q_heads = kv_heads * group
    total = sum(query_lens)
    qkv = torch.randn(total, q_heads + 2 * kv_heads, head_dim, generator=gen, device=device,
                      dtype=dtype)  # fmt: skip
    q, k, v = qkv.split([q_heads, kv_heads, kv_heads], dim=1)
    # The new tokens' keys and values are also in the cache, at their positions' slots.
    seq = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(query_lens))
    pos = torch.cat([torch.arange(length - n, length) for n, length in zip(query_lens, seq_lens)])
    blocks = block_tables[seq.to(device), (pos // BLOCK_SIZE).to(device)].long()
    slots = (pos % BLOCK_SIZE).to(device)
    cache[blocks, 0, slots] = k
    cache[blocks, 1, slots] = v
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return q, k, v, cache, block_tables, starts.to(device), lens.to(device)


def check_one(index: int, device: str) -> None:
    """Candidate `index` of the extend Selector on every dtype, shape and batch: a JSON
    line per case, printed as it passes (after a fault, the case is the one after the last)."""
    from kernels.attention_reference import paged_attention
    from kernels.extend_attention import SELECTOR

    candidate = SELECTOR.candidates[index]
    fn = SELECTOR.variants[candidate.variant]
    for dtype in DTYPES[device]:
        for kv_heads, group, head_dim in SHAPES[device]:
            for name, (query_lens, seq_lens) in BATCHES[device].items():
                q, k, v, cache, tables, starts, lens = _inputs(
                    device, query_lens, seq_lens, kv_heads, group, head_dim, dtype
                )
                scale = head_dim**-0.5
                out = torch.full_like(q, float("nan"))
                fn(q, k, v, cache, tables, starts, lens, max(query_lens), scale, out,
                   **candidate.kwargs)  # fmt: skip
                if device == "cuda":
                    torch.cuda.synchronize()
                ref = paged_attention(q.float(), cache.float(), tables, query_lens, seq_lens,
                                      scale)  # fmt: skip
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                row = {
                    "dtype": str(dtype).removeprefix("torch."),
                    "shape": f"kv{kv_heads} g{group} d{head_dim}",
                    "batch": name,
                    "max_rel_error": err,
                    "ok": err <= TOLERANCE[dtype],
                }
                print(json.dumps(row), flush=True)


def _run_child(index: int, device: str) -> tuple[list[dict], list[str] | None]:
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    argv = ["--one", str(index), "--device", device, "--out", os.devnull]
    proc = subprocess.run(
        [sys.executable, "-m", __spec__.name, *argv],
        capture_output=True, text=True, env=env, timeout=400,
    )  # fmt: skip
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return rows, None if proc.returncode == 0 else proc.stderr.strip().splitlines()[-3:]


def sweep(device: str) -> list[dict]:
    from kernels.extend_attention import SELECTOR

    usable = SELECTOR.usable(torch.device(device))
    indices = [i for i, c in enumerate(SELECTOR.candidates) if c in usable]
    if device != "cuda":
        indices = indices[:1]  # a dry run: one candidate
    with ThreadPoolExecutor(4) as pool:  # children share the GPU; compiling is the cost
        outcomes = list(pool.map(lambda i: _run_child(i, device), indices))
    results = []
    for index, (rows, error) in zip(indices, outcomes):
        candidate = SELECTOR.candidates[index]
        entry = {"variant": candidate.variant, "config": candidate.kwargs, "rows": rows}
        failed = [r for r in rows if not r["ok"]]
        if error:
            entry["error"] = error
            verdict = f"FAULT after {len(rows)} cases: " + " | ".join(error)
        else:
            verdict = f"{len(failed)} wrong: {failed}" if failed else f"all {len(rows)} ok"
        results.append(entry)
        print(f"{candidate.variant:5} {candidate.kwargs}: {verdict}", flush=True)
    return results


def main(argv: list[str] | None = None) -> dict | None:
    parser = script_parser(__doc__)
    parser.add_argument("--one", type=int, help="(a child) check one candidate, print rows")
    args = parser.parse_args(argv)
    if args.one is not None:
        check_one(args.one, args.device)
        return None
    with Sections(args, script="extend_candidates") as section:
        section("candidates", lambda: sweep(section.device))
        return section.results


if __name__ == "__main__":
    main()
