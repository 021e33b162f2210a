"""Compile the extend-attention candidates for sm_90 on any machine, no GPU needed.

Triton lowers each kernel to PTX for a Hopper target and the bundled ptxas assembles it;
its report gives what decides a candidate's speed before it ever runs: registers a
thread, bytes spilled to local memory, and whether ptxas serialized the wgmma
instructions (too few registers to keep them in flight). Run it without
TRITON_INTERPRET (the interpreter replaces the kernels with Python):
`python -m kernels.compile_report` prints one JSON line per candidate.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.cache import get_cache_manager

from kernels.attention_checks import dot_precision
from kernels.extend_attention import SELECTOR, _extend_kernel
from kernels.extend_attention_tma import _extend_tma_kernel

TARGET = GPUTarget("cuda", 90, 32)
KV_HEADS, GROUP, HEAD_DIM, PAGE_SIZE = 8, 4, 128, 16  # Llama-3-8B's attention heads
INDEX_ARGS = ("block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr")  # int32 tensors
REPORT = "ptxas_report.log"  # in the kernel's Triton cache folder


def _ptxas() -> str:
    default = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return os.environ.get("TRITON_PTXAS_PATH", default)


def _arg_type(name: str, block_n: int) -> str:
    """A runtime argument's Triton type, from the kernels' naming: bf16 tensors, int32
    index tensors, int32 strides, K/V tensor descriptors of one [block_n, HEAD_DIM] box."""
    if name.endswith("_desc"):
        return f"tensordesc<bf16[{block_n}, {HEAD_DIM}]>"
    if name.endswith("_ptr"):
        return "*i32" if name in INDEX_ARGS else "*bf16"
    if name.startswith("stride_"):
        return "i32"
    if name == "qk_scale":
        return "fp32"
    raise ValueError(f"no type known for kernel argument {name!r}")


def _signature(variant: str, block_n: int) -> tuple:
    """(kernel, signature, constexprs) of one extend variant at bf16 and HEAD_DIM."""
    kernel = _extend_tma_kernel if variant == "tma" else _extend_kernel
    constexprs = dict(GROUP=GROUP, NUM_KV_HEADS=KV_HEADS, HEAD_DIM=HEAD_DIM,
                      PAGE_SIZE=PAGE_SIZE, DOT_PRECISION=dot_precision(torch.bfloat16))  # fmt: skip
    if variant != "tma":
        constexprs["BLOCK_D"] = HEAD_DIM
    names = [n for n in kernel.arg_names if not n.isupper()]  # constexprs are upper case
    return kernel, {n: _arg_type(n, block_n) for n in names}, constexprs


def compile_candidate(variant: str, config: dict) -> dict:
    """ptxas's report on one candidate compiled for sm_90a: registers, spill bytes,
    whether its wgmma instructions were serialized."""
    config = dict(config)
    kernel, sig, constexprs = _signature(variant, config["block_n"])
    constexprs.update(BLOCK_M=config["block_m"], BLOCK_N=config["block_n"])
    if variant == "tma":
        constexprs.update(PREFIX_N=min(config["block_n"], 32),
                          PIPELINE=bool(config.get("pipeline", False)))  # fmt: skip
    # As a launch specializes them: 16-byte aligned pointers, strides multiples of 16
    # (a fused qkv projection's rows and heads); a block table's row length may be odd.
    aligned = [n for n, t in sig.items() if t.startswith("*") or n.startswith("stride_")]
    attrs = {
        (kernel.arg_names.index(n),): [["tt.divisibility", 16]]
        for n in aligned
        if n != "stride_table"
    }
    sig.update(dict.fromkeys(constexprs, "constexpr"))
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=config["num_warps"], num_stages=config["num_stages"])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # Triton prints its ptxas log when it runs it
        compiled = triton.compile(src, target=TARGET, options=options)
    cache = get_cache_manager(compiled.hash)
    report = printed.getvalue()
    if "registers" not in report:  # a kernel Triton had cached: its report, or ptxas again
        path = cache.get_file(REPORT)
        report = Path(path).read_text() if path else _run_ptxas(compiled.asm["ptx"])
    cache.put(report, REPORT, binary=False)
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    return {
        "variant": variant,
        "config": config,
        "registers": int(registers.group(1)) if registers else None,
        "spill_bytes": int(spills.group(1)) if spills else None,
        "shared_bytes": compiled.metadata.shared,
        "wgmma_serialized": "wgmma.mma_async instructions are serialized" in report,
    }


def _run_ptxas(ptx_text: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(ptx_text)
        return subprocess.run(
            [_ptxas(), "-arch=sm_90a", "-v", ptx, "-o", os.path.join(tmp, "kernel.o")],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip


def _report(candidate) -> dict:
    return compile_candidate(candidate.variant, candidate.kwargs)


def main() -> None:
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    with ProcessPoolExecutor(min(os.cpu_count() or 1, len(SELECTOR.candidates))) as pool:
        for report in pool.map(_report, SELECTOR.candidates):
            print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
