"""Decode's projections, a few rows against a weight matrix, on one GPU: torch's
matmul (cuBLAS) against the Triton kernels of kernels/skinny_linear.py (`fma`: rows
summed in registers, up to 4 rows; `dot`: tl.dot on rows padded to 16), each as a
fraction of the copy bandwidth over the bytes it must read, every config timed with
the weight out of the L2 cache (as a decode step reads it, and as the engine's tuner
times them: `torch_hot_ms` is cuBLAS back to back, a weight of up to the L2's size
then read from the cache). An experiment: a kernel serves the engine only where it
reads faster here.

Why: DeepSeek-V2-Lite's batch-1 step spends 1.33 ms in such matmuls reading at 0.64
of the copy bandwidth (bench/results/v2lite_profile_s73.json), and the dense default
model's batch-1 decode is held to 0.76 of its floor.

Shapes (N, K): V2-Lite's q and kv_a (fused), o, shared experts' gate/up and down,
lm_head; Llama-3-8B's qkv, o, gate/up, down; at 1, 4 and 16 rows, bf16.

Usage: python -m bench.gpu.skinny_gemm --out FILE [--skip NAME ...] [--device cpu]
Sections: ceilings, shapes. `--device cpu` is a dry run at tiny shapes through
Triton's interpreter (float32, two configs a kernel).
"""

from __future__ import annotations

import torch

from bench.gpu.ceilings import measure
from bench.gpu.sections import Sections, script_parser
from bench.gpu.timing import cold_ms, queued_ms
from kernels.skinny_linear import (
    DOT_SWEEP,
    FMA_MAX_ROWS,
    FMA_SWEEP,
    MAX_PRODUCTS,
    skinny_dot,
    skinny_fma,
)

V2_LITE = {"qkv_a": (3648, 2048), "o": (2048, 2048), "shared_gate_up": (5632, 2048),
           "shared_down": (2048, 2816), "lm_head": (102400, 2048)}  # fmt: skip
LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
            "down": (4096, 14336)}  # fmt: skip
KERNELS = {"fma": (skinny_fma, FMA_SWEEP), "dot": (skinny_dot, DOT_SWEEP)}
GPU = dict(shapes={**{f"v2_lite/{k}": v for k, v in V2_LITE.items()},
                   **{f"llama3_8b/{k}": v for k, v in LLAMA_8B.items()}},
           rows=(1, 4, 16), kernels=KERNELS, dtype=torch.bfloat16)  # fmt: skip
CPU = dict(shapes={"odd": (37, 70), "wide": (20, 130)}, rows=(1, 3),
           kernels={name: (fn, cfgs[:1] + cfgs[-1:]) for name, (fn, cfgs) in KERNELS.items()},
           dtype=torch.float32)  # fmt: skip


def shape_rows(sizes: dict, ceilings: dict, device: str) -> list[dict]:
    copy = ceilings.get("copy_gbps") or 0.0
    return [one_shape(name, n, k, m, sizes, copy, device)
            for name, (n, k) in sizes["shapes"].items() for m in sizes["rows"]]  # fmt: skip


def fits(kernel: str, rows: int, cfg: dict) -> bool:
    if kernel == "dot":
        return True
    return (
        rows <= FMA_MAX_ROWS
        and (1 << (rows - 1).bit_length()) * cfg["block_n"] * cfg["block_k"] <= MAX_PRODUCTS
    )


def one_shape(name: str, n: int, k: int, m: int, sizes: dict, copy: float, device: str) -> dict:
    """torch's time and each kernel's fastest config at one shape, with its error against
    float32."""
    gen = torch.Generator(device=device).manual_seed(n * 7 + k + m)
    x = torch.randn(m, k, device=device, generator=gen).to(sizes["dtype"])
    w = (torch.randn(n, k, device=device, generator=gen) / k**0.5).to(sizes["dtype"])
    out = torch.empty(m, n, device=device, dtype=x.dtype)
    want = x.float() @ w.float().T
    nbytes = (n * k + m * k + m * n) * w.element_size()
    row = {"shape": name, "rows": m, "n": n, "k": k, "bytes": nbytes}
    row["torch_ms"] = cold_ms(lambda: x @ w.T, device)
    row["torch_hot_ms"] = queued_ms(lambda: x @ w.T, device)
    fraction = (lambda ms: nbytes / (ms * 1e-3) / (copy * 1e9)) if copy else (lambda ms: None)
    row["torch_fraction_of_copy"] = fraction(row["torch_ms"])
    line = (f"{name} M={m}: torch {row['torch_ms'] * 1e3:.1f} us "
            f"(back to back {row['torch_hot_ms'] * 1e3:.1f})")  # fmt: skip
    for kernel, (fn, configs) in sizes["kernels"].items():
        best = None
        for cfg in configs:
            if not fits(kernel, m, cfg):
                continue
            try:
                got = fn(x, w, out, **cfg)
            except Exception as error:  # noqa: BLE001 - a config that does not compile
                row.setdefault("failed", []).append({kernel: cfg, "error": repr(error)[:200]})
                continue
            err = ((got.float() - want).abs().max() / want.abs().max()).item()
            ms = cold_ms(lambda f=fn, c=cfg: f(x, w, out, **c), device)
            if best is None or ms < best["ms"]:
                best = {"config": cfg, "ms": ms, "max_rel_error": err,
                        "speedup": row["torch_ms"] / ms,
                        "fraction_of_copy": fraction(ms)}  # fmt: skip
        row[kernel] = best
        if best is not None:
            line += (f", {kernel} {best['ms'] * 1e3:.1f} us ({best['speedup']:.2f}x, "
                     f"err {best['max_rel_error']:.1e}) {best['config']}")  # fmt: skip
    print(line, flush=True)
    return row


def main(argv: list[str] | None = None) -> dict:
    args = script_parser(__doc__).parse_args(argv)
    sizes = GPU if args.device == "cuda" else CPU
    with Sections(args, script="skinny_gemm") as section:
        ceilings = section("ceilings", lambda: measure(args.device))
        if ceilings is None:
            raise SystemExit("no ceilings, nothing to compare against")
        section("shapes", lambda: shape_rows(sizes, ceilings, args.device))
        return section.results


if __name__ == "__main__":
    main()
