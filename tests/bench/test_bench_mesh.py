"""`yinian bench serve` against our own mesh: a complete report and plots."""

from __future__ import annotations

import json

from paths import ROOT

from bench.loadgen.cli import run
from yinian.mesh import Mesh, MeshSpec

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TRACE = ROOT / "bench" / "loadgen" / "data" / "mooncake_small.jsonl"


def test_bench_serve_against_the_mesh(model_dir, tmp_path):
    folder = str(model_dir("tiny-llama"))
    spec = MeshSpec(model=folder, workers=2, port=0, engine_argv=["--device", "cpu"])
    with Mesh(spec) as mesh:
        rc = run(
            [
                "serve",
                "--base-url",
                mesh.url,
                "--model",
                folder,
                "--model-name",
                "tiny-llama",
                "--dataset-name",
                "random",
                "--num-prompts",
                "24",
                "--random-input-len",
                "48",
                "--random-output-len",
                "12",
                "--request-rates",
                "20,inf",
                "--seed",
                "3",
                "--disable-tqdm",
                "--result-dir",
                str(tmp_path),
                "--result-filename",
                "mesh.json",
                "--goodput",
                "ttft:5000",
                "tpot:1000",
            ]
        )
        trace_rc = run(
            ["serve", "--base-url", mesh.url, "--model", folder, "--model-name", "tiny-llama",
             "--dataset-name", "mooncake", "--dataset-path", str(TRACE), "--num-prompts", "30",
             "--prompt-format", "ids", "--mooncake-slowdown-factor", "0.25", "--disable-tqdm",
             "--no-plots", "--result-dir", str(tmp_path), "--result-filename", "trace.json"]
        )  # fmt: skip
    assert rc == 0 and trace_rc == 0
    # a replayed trace: every request served, sent at its time, its shared blocks cached
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert trace["completed"] == 30 and trace["failed"] == 0
    stamps = [json.loads(line)["timestamp"] for line in TRACE.read_text().splitlines()[:30]]
    late = [s - (t - stamps[0]) / 1e3 * 0.25 for s, t in zip(trace["start_times"], stamps)]
    assert min(late) > -0.01 and max(late) < 0.5, late
    assert trace["ideal_cached_tokens_total"] > 0 and trace["cached_of_ideal"] >= 0.9
    sweep = json.loads((tmp_path / "mesh-sweep.json").read_text())
    assert len(sweep["runs"]) == 2
    for r in sweep["runs"]:
        assert r["completed"] == 24 and r["failed"] == 0
        assert r["total_input_tokens"] == 24 * 48 and r["total_output_tokens"] == 24 * 12
        assert r["median_ttft_ms"] > 0 and r["median_tpot_ms"] > 0 and r["p99_itl_ms"] > 0
        assert r["request_goodput"] is not None
    assert sweep["plots"]
    for png in sweep["plots"]:
        path = tmp_path / png if not png.startswith("/") else png
        assert open(path, "rb").read(8) == PNG_MAGIC
