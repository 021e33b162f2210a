"""`yinian bench serve` against our own mesh: a complete report and plots."""

from __future__ import annotations

import json

from bench.loadgen.cli import run
from yinian.mesh import Mesh, MeshSpec

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


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
    assert rc == 0
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
