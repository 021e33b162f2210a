"""`yinian bench engine`: offline throughput in process, alone and against transformers."""

from __future__ import annotations

import json

import pytest

from bench.loadgen import datasets
from bench.loadgen.cli import run
from bench.loadgen.engine_bench import run_engine_bench

FIGURES = ("elapsed_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s")


def _engine_argv(model, tmp_path, *extra):
    return [
        "engine", "--model", str(model), "--num-prompts", "8", "--input-len", "32",
        "--output-len", "8", "--device", "cpu", "--dtype", "float32",
        "--result-dir", str(tmp_path), "--result-filename", "engine", *extra,
    ]  # fmt: skip


def test_engine_bench_writes_throughput(model_dir, tmp_path, capsys):
    assert run(_engine_argv(model_dir("tiny-llama"), tmp_path)) == 0
    result = json.loads((tmp_path / "engine.json").read_text())
    engine = result["engine"]
    assert engine["num_requests"] == 8
    assert engine["total_input_tokens"] == 8 * 32 and engine["total_output_tokens"] == 8 * 8
    assert all(engine[k] > 0 for k in FIGURES)
    assert engine["output_tokens_per_s"] == pytest.approx(64 / engine["elapsed_s"])
    assert "peer" not in result and result["dataset"]["prompt_format"] == "ids"
    assert "out tok/s" in capsys.readouterr().out


def test_engine_options_as_a_dict(model_dir, tmp_path):
    model = model_dir("tiny-llama")
    tok = datasets.load_tokenizer(model)
    requests = datasets.random_requests(tok, 6, 24, 5, range_ratio=0.5, seed=4)
    result = run_engine_bench(
        model,
        requests,
        engine_options={"device": "cpu", "dtype": "float32", "max_num_seqs": 2},
        result_dir=str(tmp_path),
        result_filename="opts",
    )
    assert result["engine_options"]["max_num_seqs"] == 2
    assert result["engine"]["total_output_tokens"] == sum(r.output_len for r in requests)
    assert (tmp_path / "opts.json").is_file()


def test_peer_transformers_reports_both_and_their_ratio(model_dir, tmp_path):
    argv = _engine_argv(model_dir("tiny-llama"), tmp_path, "--peer", "transformers")
    assert run(argv) == 0
    result = json.loads((tmp_path / "engine.json").read_text())
    ours, peer = result["engine"], result["peer"]
    assert "error" not in peer, peer.get("error")
    assert all(peer[k] > 0 for k in FIGURES)
    # Exactly output_len tokens each, so both did the same work.
    assert peer["total_output_tokens"] == ours["total_output_tokens"] == 64
    assert result["same_work"] is True
    assert "generate_batch" in peer["call"] and "eos_token_id=-1" in peer["call"]
    for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s"):
        assert result["ratio"][key] == pytest.approx(ours[key] / peer[key])


def test_peer_with_varied_output_lengths(model_dir, tmp_path):
    argv = _engine_argv(
        model_dir("tiny-llama"), tmp_path, "--peer", "transformers", "--random-range-ratio", "0.5"
    )
    assert run(argv) == 0
    result = json.loads((tmp_path / "engine.json").read_text())
    assert "error" not in result["peer"], result["peer"].get("error")
    assert result["same_work"] is True  # per-request max_new_tokens honoured


def test_peer_without_continuous_batching_reports_the_error(monkeypatch, model_dir):
    import transformers

    from bench.loadgen.engine_bench import run_transformers

    class OldModel:  # what a transformers before 4.53 would give: no generate_batch
        def to(self, device):
            return self

    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: OldModel()
    )
    peer = run_transformers(str(model_dir("tiny-llama")), [[1, 2, 3]], [4], {"device": "cpu"}, {})
    assert "no generate_batch" in peer["error"]
