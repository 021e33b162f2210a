"""Decode's projections, a few rows against a weight matrix, on one GPU: torch's
matmul (cuBLAS) against a Triton kernel that streams the weight once (each program
a block of the weight's rows, all of K, the few input rows padded to a 16-row dot),
each as a fraction of the copy bandwidth over the bytes it must read. An
experiment: the kernel goes into kernels/ only if it reads faster here.

Why: DeepSeek-V2-Lite's batch-1 step spends 1.33 ms in such matmuls reading at 0.64
of the copy bandwidth (bench/results/v2lite_profile_s73.json), and the dense default
model's batch-1 decode is held to 0.76 of its floor.

Shapes (N, K): V2-Lite's q, kv_a, o, shared experts' gate/up and down, lm_head;
Llama-3-8B's qkv, o, gate/up, down; at 1, 4 and 16 rows, bf16.

Usage: python -m bench.gpu.skinny_gemm --out FILE [--skip NAME ...] [--device cpu]
Sections: ceilings, shapes. `--device cpu` is a dry run at tiny shapes through
Triton's interpreter (float32, two configs).
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from bench.gpu.ceilings import measure
from bench.gpu.sections import Sections, script_parser
from bench.gpu.timing import queued_ms

V2_LITE = {"q": (3072, 2048), "kv_a": (576, 2048), "o": (2048, 2048),
           "shared_gate_up": (5632, 2048), "shared_down": (2048, 2816),
           "lm_head": (102400, 2048)}  # fmt: skip
LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
            "down": (4096, 14336)}  # fmt: skip
CONFIGS = [dict(block_n=n, block_k=k, num_warps=w, num_stages=s) for n, k, w, s
           in itertools.product((16, 32, 64), (128, 256, 512), (2, 4), (3, 4, 5))]  # fmt: skip
GPU = dict(shapes={**{f"v2_lite/{k}": v for k, v in V2_LITE.items()},
                   **{f"llama3_8b/{k}": v for k, v in LLAMA_8B.items()}},
           rows=(1, 4, 16), configs=CONFIGS, dtype=torch.bfloat16)  # fmt: skip
CPU = dict(shapes={"tiny/a": (40, 72), "tiny/b": (17, 33)}, rows=(1, 3),
           configs=CONFIGS[:1] + CONFIGS[-1:], dtype=torch.float32)  # fmt: skip


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = offs_n % N  # wrapped: the weight loads need no row mask; extra columns are not stored
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rows[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        x = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        w = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def skinny_matmul(x, w, out, block_n, block_k, num_warps, num_stages):
    """out [M, N] = x [M, K] @ w [N, K]^T, M <= 16, float32 accumulation."""
    m, k = x.shape
    n = w.shape[0]
    if m > 16 or w.shape[1] != k or not w.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"need x [M<=16, K] and contiguous w [N, K], got {x.shape}, {w.shape}")
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def shape_rows(sizes: dict, ceilings: dict, device: str) -> list[dict]:
    copy = ceilings.get("copy_gbps") or 0.0
    cases = itertools.product(sizes["shapes"].items(), sizes["rows"])
    return [one_shape(name, n, k, m, sizes, copy, device) for (name, (n, k)), m in cases]


def one_shape(name: str, n: int, k: int, m: int, sizes: dict, copy: float, device: str) -> dict:
    """torch's time and the fastest config's at one shape, with its error against float32."""
    gen = torch.Generator(device=device).manual_seed(n * 7 + k + m)
    x = torch.randn(m, k, device=device, generator=gen).to(sizes["dtype"])
    w = (torch.randn(n, k, device=device, generator=gen) / k**0.5).to(sizes["dtype"])
    out = torch.empty(m, n, device=device, dtype=x.dtype)
    want = x.float() @ w.float().T
    nbytes = (n * k + m * k + m * n) * w.element_size()
    row = {"shape": name, "rows": m, "n": n, "k": k, "bytes": nbytes}
    row["torch_ms"] = queued_ms(lambda: x @ w.T, device)
    best = None
    for cfg in sizes["configs"]:
        try:
            got = skinny_matmul(x, w, out, **cfg)
        except Exception as error:  # noqa: BLE001 - a config that does not compile
            row.setdefault("failed", []).append({**cfg, "error": repr(error)[:200]})
            continue
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        ms = queued_ms(lambda c=cfg: skinny_matmul(x, w, out, **c), device)
        if best is None or ms < best["ms"]:
            best = {"config": cfg, "ms": ms, "max_rel_error": err}
    row["triton"] = best
    if best is None:
        return row
    row["speedup"] = row["torch_ms"] / best["ms"]
    if copy:
        row["torch_fraction_of_copy"] = nbytes / (row["torch_ms"] * 1e-3) / (copy * 1e9)
        row["triton_fraction_of_copy"] = nbytes / (best["ms"] * 1e-3) / (copy * 1e9)
    print(f"{name} M={m}: torch {row['torch_ms'] * 1e3:.1f} us, triton {best['ms'] * 1e3:.1f} us "
          f"({row['speedup']:.2f}x) {best['config']}, rel err {best['max_rel_error']:.1e}",
          flush=True)  # fmt: skip
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
