"""The MLA GPU benchmark's dry run on the CPU (tiny sizes, the tiny DeepSeek
presets, kernels through Triton's interpreter): every section runs or is
skipped for lack of a GPU, and what it reports is sound."""

from __future__ import annotations

import json

from bench.gpu import mla
from bench.gpu.sections import outcome


def test_dry_run_reports_every_section(tmp_path):
    out = tmp_path / "mla.json"
    mla.main(["--device", "cpu", "--out", str(out)])
    results = json.loads(out.read_text())
    engine = [f"engine/{p}/{d}" for p in mla.CHECKED for d in ("float32", "bfloat16")]
    for name in ("ceilings", "decode_kernel", "v2_lite_decode", *engine):
        expected = "skipped" if name.endswith("bfloat16") else "ok"
        assert outcome(results[name]) == expected, results[name]
    kernel = results["decode_kernel"]
    assert len(kernel) == len(mla.CPU["kernel_cases"]) * len(mla.CPU["heads"])
    assert all(row["max_rel_error"] < 1e-5 and row["latent_gbps"] > 0 for row in kernel)
    lite = results["v2_lite_decode"]
    # Figures only (the CPU's ceilings, timed at tiny sizes, bound nothing).
    assert lite["batch1"]["fraction_of_bandwidth_floor"] > 0
    assert lite["batch_many"]["step_over_roofline"] > 0
    assert lite["preset"] == "tiny-deepseek-v2" and lite["active_parameters"] > 0
    for name in engine[::2]:  # float32: the kernels give the references' greedy tokens
        assert results[name]["passed"] and all(g["equal"] for g in results[name]["greedy"])
