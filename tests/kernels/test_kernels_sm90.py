"""Every extend-attention candidate compiles for Hopper (sm_90a) without register spills
and with its wgmma instructions kept asynchronous: checked on any machine through
Triton's code generator and the bundled ptxas (no GPU needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from paths import ROOT

from kernels.compile_report import _ptxas
from kernels.extend_attention import SELECTOR


@pytest.mark.skipif(not os.path.exists(_ptxas()), reason="this Triton build has no ptxas")
def test_extend_candidates_compile_for_sm90_without_spills():
    # The kernels must be real JIT functions, not the interpreter's stand-ins.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "kernels.compile_report"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["variant"], r["config"]) for r in reports] == [
        (c.variant, c.kwargs) for c in SELECTOR.candidates
    ]
    for r in reports:
        assert r["spill_bytes"] == 0, r
        assert not r["wgmma_serialized"], r
        assert r["shared_bytes"] <= 227 * 1024, r  # an H100/H200 SM's shared memory per block
