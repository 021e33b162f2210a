"""Every GPU experiment script's dry run (`--device cpu`: a tiny preset at tiny sizes),
in process: each section has a result or an explicit skip with its reason, never an
error and never missing, so a script cannot rot unseen between GPU runs."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
from paths import ROOT

from bench.gpu import SCRIPTS
from bench.gpu.sections import outcome

CUDA_ONLY = "skipped"
# Per script, every section it must write in a dry run, and how it must end.
EXPECTED = {
    "engine_baseline": {"ceilings": "ok", "model": "ok", "decode": "ok", "offline": "ok"},
    "kernels_bench": {
        "ceilings": "ok",
        "decode_attention": "ok",
        "prefill_attention": "ok",
        "prefill_variants": CUDA_ONLY,
        "ops": "ok",
        "rotary_configs": CUDA_ONLY,
        "end_to_end": "ok",
    },
    "engine_checks": {"spread/tiny-llama": "ok", "tiny-llama/float32": "ok"},
    "extend_candidates": {"candidates": "ok"},
    "async_scheduling": {"tiny-qwen3": "ok"},
    "decode_profile": {"ceilings": "ok", "model": "ok", "batch_1": "ok", "batch_4": "ok"},
    "pd_cuda_ipc": {
        "ceilings": "ok",
        "transfer_cuda_ipc": CUDA_ONLY,
        "transfer_tcp": "ok",
        "equality": "ok",
        "ttft": "ok",
    },
    "pd_nccl": {
        "ceilings": "ok",
        "peer_ceilings": CUDA_ONLY,
        "transfer_nccl": CUDA_ONLY,
        "equality": "ok",
        "ttft": "ok",
        "kill": "ok",
        "kill_tiny": CUDA_ONLY,
    },
    "serving": {"ceilings": "ok", "serve": "ok", "offline": "ok", "peer": "ok"},
    "parallel": {
        "ceilings": "ok",
        "equality": "ok",
        "pp_overlap": "ok",
        "tp_scaling": CUDA_ONLY,
        "pp_throughput": CUDA_ONLY,
    },
    "long_streams": {"ceilings": "ok", "colocated": "ok", "split": "ok"},
    "speculative": {"ceilings": "ok", "default": "ok", "tiny-llama": "ok"},
    "structured": {"ceilings": "ok", "constrained": "ok", "tools": "ok", "default_dtypes": "ok"},
    "default_dtypes": {"default_dtypes": "ok"},
    "launch_cost": {"d3_p0": "ok", "d3_p8": "ok", "d0_p16": "ok", "ops": "ok"},
    "saturation": {
        "ceilings": "ok",
        "model": "ok",
        "offline": "ok",
        "rate_40": "ok",
        "host_profile": "ok",
        "runtime_calls": "ok",
        "profile": "ok",
    },
    "kvstore": {
        "ceilings": "ok",
        "host_load": "ok",
        "ttft_by_tier": "ok",
        "cross_worker": "ok",
        "workload": "ok",
    },
    "kv_serving": {"ceilings": "ok", "default": "ok", "bare": "ok"},
    "lend_copy": {"ceilings": "ok", "host_tier": "ok", "store_region": "ok"},
    "pinned_cost": {"ceilings": "ok", "registered": "ok", "host_tier": "ok"},
    "host_writes": {"ceilings": "ok", "alone": "ok", "steps": "ok"},
    "hit_check": {
        "ceilings": "ok",
        "reference": "ok",
        "kernel": "ok",
        "engine": "ok",
        "no_host": "ok",
    },  # fmt: skip
    "prompt_rows": {"ceilings": "ok", "grid": "ok"},
    "experts": {
        "eplb_replay": "ok",
        "live_skew": "ok",
        "throughput": CUDA_ONLY,
        "throughput_2": CUDA_ONLY,
        "throughput_stream": CUDA_ONLY,
        "colocated_eager": CUDA_ONLY,
    },
    "expert_mailbox": {
        "round_trip": "ok",
        "round_trip_no_spin": "ok",
        "round_trip_mps": CUDA_ONLY,
        "member_compute": "ok",
    },
    "process_hop": {
        "in_process": CUDA_ONLY,
        "cross_process": CUDA_ONLY,
        "cross_process_mps": CUDA_ONLY,
    },
    "memops_probe": {"in_graph": CUDA_ONLY, "eager": CUDA_ONLY, "in_graph_mps": CUDA_ONLY},
    "expert_stream": {
        "four_members_graphs": CUDA_ONLY,
        "four_members_eager": CUDA_ONLY,
        "one_member_graphs": CUDA_ONLY,
    },
    "mla": {
        "ceilings": "ok",
        "decode_kernel": "ok",
        "v2_lite_decode": "ok",
        "engine/tiny-deepseek-v2/float32": "ok",
        "engine/tiny-deepseek-v2/bfloat16": CUDA_ONLY,
        "engine/tiny-deepseek-v3/float32": "ok",
        "engine/tiny-deepseek-v3/bfloat16": CUDA_ONLY,
    },
    "mla_sweep": {"ceilings": "ok", "candidates": "ok", "splits": "ok"},
    "skinny_gemm": {"ceilings": "ok", "shapes": "ok"},
}


def test_every_script_has_a_dry_run():
    assert set(EXPECTED) == set(SCRIPTS)
    folder = ROOT / "bench" / "gpu"
    runnable = {p.stem for p in folder.glob("*.py") if "__main__" in p.read_text()}
    assert runnable == set(SCRIPTS), "a script under bench/gpu/ is missing from SCRIPTS"


@pytest.mark.parametrize("script", SCRIPTS)
def test_dry_run(script, tmp_path):
    module = importlib.import_module(f"bench.gpu.{script}")
    out = tmp_path / f"{script}.json"
    module.main(["--device", "cpu", "--out", str(out)])
    results = json.loads(out.read_text())
    outcomes = {name: outcome(results[name]) for name in results["seconds"]}
    errors = {n: results[n]["error"][-1500:] for n, o in outcomes.items() if o == "error"}
    assert not errors, errors
    assert outcomes == EXPECTED[script]
    for name, how in outcomes.items():
        if how == "skipped":
            assert results[name]["skipped"].startswith("needs "), results[name]


def test_kv_serving_pairs_each_repeated_mesh_with_the_bare_run_of_its_round():
    from bench.gpu.kv_serving_compare import kind_of, pairs, run_names

    names = run_names(["bare", "default", "bare", "default", "no_writes"])
    assert names == ["bare", "default", "bare_2", "default_2", "no_writes"]
    assert [kind_of(n) for n in names] == ["bare", "default", "bare", "default", "no_writes"]
    assert pairs(names) == [("default", "bare"), ("default_2", "bare_2"), ("no_writes", "bare")]
    assert pairs(run_names(["default", "default", "bare"])) == [
        ("default", "bare"),
        ("default_2", "bare"),
    ]


def test_kv_serving_pools_repeated_rounds_against_the_bare_runs_and_their_spread():
    from bench.gpu.kv_serving_compare import pooled

    def run(ttft: float, tps: float) -> dict:
        row = {"request_rate": 8.0, "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft,
               "p99_tpot_ms": 10.0, "output_throughput": tps}  # fmt: skip
        return {"rows": [row]}

    results = {"bare": run(50.0, 1000.0), "default": run(54.0, 990.0),
               "bare_2": run(60.0, 1000.0), "default_2": run(56.0, 1010.0)}  # fmt: skip
    out = pooled(results, list(results))
    assert out["runs"] == {"bare": 2, "default": 2}
    assert out["default"][0]["median_ttft_ms"] == 55.0 / 55.0
    assert out["default"][0]["output_throughput"] == 1000.0 / 1000.0
    assert out["bare_spread"][0]["median_ttft_ms"] == 60.0 / 50.0
    assert pooled({"bare": run(50.0, 1.0), "default": run(51.0, 1.0)}, ["bare", "default"]) == {}


def test_kv_serving_pools_every_request_of_a_kind_over_its_runs(tmp_path):
    """The pooled figures are those of all the kind's requests together (a failed
    request left out), set over the bare runs'; a run missing a rate is skipped."""
    import numpy as np

    from bench.gpu.kv_serving_requests import pooled_requests

    def write(name: str, ttfts: list[float], failed: int = 0) -> None:
        n = len(ttfts)
        e2els = [t + 0.127 * (1 + i % 3) for i, t in enumerate(ttfts)]
        errors = ["boom"] * failed + [""] * (n - failed)
        data = {"ttfts": ttfts, "e2els": e2els, "output_lens": [128] * n, "errors": errors}
        (tmp_path / f"{name}-rate8.json").write_text(json.dumps(data))

    rng = np.random.default_rng(3)
    runs = {"bare": rng.uniform(0.04, 0.06, 320), "bare_2": rng.uniform(0.04, 0.09, 320),
            "default": rng.uniform(0.04, 0.07, 320)}  # fmt: skip
    for name, ttfts in runs.items():
        write(name, list(ttfts), failed=2 if name == "default" else 0)
    out = pooled_requests(tmp_path, ["bare", "default", "bare_2", "default_2"], [8.0, 16.0])
    bare = np.concatenate([runs["bare"], runs["bare_2"]]) * 1e3
    ours = runs["default"][2:] * 1e3
    assert out["bare"][0]["requests"] == 640 and out["default"][0]["requests"] == 318
    assert out["bare"][0]["p99_ttft_ms"] == pytest.approx(np.percentile(bare, 99))
    assert out["default_to_bare"][0]["median_ttft_ms"] == pytest.approx(
        np.median(ours) / np.median(bare)
    )
    # TPOT: the time after the first token over the 127 further tokens: 1, 2 or 3 ms
    assert out["bare"][0]["p99_tpot_ms"] == pytest.approx(3.0)
    assert out["bare"][1] == {"request_rate": 16.0, "requests": 0, "median_ttft_ms": None,
                              "p99_ttft_ms": None, "p99_tpot_ms": None}  # fmt: skip
    assert out["default_to_bare"][1]["p99_ttft_ms"] is None


def test_kv_serving_pool_pools_the_requests_of_runs_from_several_calls(tmp_path):
    """--requests FOLDER: every request of the per-request files there, by kind (a
    warm-up's left out), each kind over the bare runs'; no result file needed."""
    from bench.kv_serving_pool import main as pool_main

    def write(name: str, ttfts: list[float], rate: float = 8.0) -> None:
        n = len(ttfts)
        data = {"request_rate": rate, "ttfts": ttfts, "e2els": [t + 0.127 for t in ttfts],
                "output_lens": [128] * n, "errors": [""] * n}  # fmt: skip
        (tmp_path / f"{name}.json").write_text(json.dumps(data))

    write("bare", [0.05] * 99 + [0.2])
    write("bare_2", [0.05] * 100)
    write("default", [0.05] * 100)
    write("bare-warmup", [9.0] * 100)
    write("bare_3-rate16", [0.5] * 100, rate=16.0)  # a sweep's file: its own rate only
    pool_main(["--requests", str(tmp_path), "--out", str(tmp_path / "pooled.out")])
    pooled = json.loads((tmp_path / "pooled.out").read_text())["requests"]
    assert pooled["bare"][0]["requests"] == 200 and pooled["default"][0]["requests"] == 100
    assert pooled["bare"][0]["median_ttft_ms"] == pytest.approx(50.0)
    assert pooled["default_to_bare"][0]["median_ttft_ms"] == pytest.approx(1.0)
    # at 16 req/s only bare_3 served: the one-rate files of 8 req/s are not counted there
    assert pooled["bare"][1]["requests"] == 100 and pooled["default"][1]["requests"] == 0
    assert pooled["bare"][1]["median_ttft_ms"] == pytest.approx(500.0)
    with pytest.raises(SystemExit):
        pool_main([])


def test_kv_serving_pool_matches_rows_by_rate_across_files_and_compares_two_codes(tmp_path):
    """Files of different rate lists pool by rate; --against sets one code's default
    runs over another's; a sweep of another prompt count is left out on request."""
    from bench.kv_serving_pool import main as pool_main

    def row(rate: float, ttft: float, prompts: int = 320) -> dict:
        return {"request_rate": rate, "completed": prompts, "failed": 0,
                "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "p99_tpot_ms": 10.0,
                "output_throughput": 100 * rate}  # fmt: skip

    def write(name: str, runs: dict) -> Path:
        path = tmp_path / name
        path.write_text(json.dumps({"ceilings": {}} | {k: {"rows": v} for k, v in runs.items()}))
        return path

    a = write(
        "a.json", {"default": [row(8, 50.0), row(16, 60.0)], "bare": [row(8, 40.0), row(16, 60.0)]}
    )
    b = write("b.json", {"bare": [row(16, 80.0), row(32, 90.0)], "default_2": [row(16, 70.0)],
                         "no_writes": [row(16, 1.0)]})  # fmt: skip
    table = pool_main([str(a), str(b), "--out", str(tmp_path / "pooled.json")])
    assert [r["request_rate"] for r in table] == [8, 16]  # 32 has no default run
    assert table[0]["median_ttft_ms"] == 50.0 / 40.0 and table[0]["runs"] == 1
    assert (
        table[1]["median_ttft_ms"] == 65.0 / 70.0 and table[1]["median_ttft_ms_spread"] == 80 / 60
    )
    assert (table[1]["runs"], table[1]["runs_compared"]) == (2, 2)
    assert json.loads((tmp_path / "pooled.json").read_text())["pooled"] == table
    old = write("old.json", {"default": [row(8, 25.0), row(16, 30.0, prompts=640)]})
    gate = pool_main([str(a), "--against", str(old), "--prompts", "320"])
    assert [(r["request_rate"], r["median_ttft_ms"]) for r in gate] == [(8, 2.0)]
