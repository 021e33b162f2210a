"""GPU experiment scripts, each run as `python -m bench.gpu.<script> --out PATH` through
the one section runner (sections.py), and the modules they share. `--device cpu` is a
script's dry run on a tiny preset; tests/bench/test_bench_gpu_dry_runs.py runs every one.

Without CUDA, importing this package selects Triton's interpreter (before any kernel
is defined) with the test suite's fixes for it, as tests/conftest.py does, so a dry
run's Triton kernels run on the CPU from the command line too."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

SCRIPTS = (
    "engine_baseline",
    "kernels_bench",
    "engine_checks",
    "extend_candidates",
    "async_scheduling",
    "decode_profile",
    "pd_cuda_ipc",
    "pd_nccl",
    "serving",
    "mla",
    "mla_sweep",
    "skinny_gemm",
    "kvstore",
    "kv_serving",
    "host_writes",
    "hit_check",
    "prompt_rows",
    "lend_copy",
    "pinned_cost",
    "experts",
    "expert_mailbox",
    "process_hop",
    "memops_probe",
    "expert_stream",
    "parallel",
    "long_streams",
    "speculative",
    "structured",
    "default_dtypes",
    "saturation",
    "launch_cost",
)


def _interpret_without_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        return
    os.environ.setdefault("TRITON_INTERPRET", "1")
    fixes = Path(__file__).resolve().parents[2] / "tests" / "triton_interpreter.py"
    if fixes.is_file():
        spec = importlib.util.spec_from_file_location("triton_interpreter", fixes)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.fix_interpreter()


_interpret_without_cuda()
