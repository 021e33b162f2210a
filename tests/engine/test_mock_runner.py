"""The mock runner: an engine without weights whose steps take a modelled time,
alone and as a mesh's worker (the services around it are real)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prompts import random_prompts

from engine import LLM, SamplingParams
from yinian.mesh import Mesh, MeshSpec
from yinian.mesh_probe import wait_indexed

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def test_a_mock_engine_answers_a_prompt_alike_each_time_in_its_modelled_time(model_dir):
    llm = LLM(model_dir("tiny-llama"), model_runner="mock", mock_step_ms=15)
    prompts = random_prompts(500, (3, 40), seed=81)
    start = time.monotonic()
    first = llm.generate(prompts, GREEDY)
    assert time.monotonic() - start >= 6 * 0.015  # a prefill and five decodes, at least
    again = llm.generate(prompts[::-1], GREEDY)[::-1]
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert len({tuple(o.outputs[0].token_ids) for o in first}) == 2
    assert again[1].num_cached_tokens == 32  # the KV cache's prefix hits, as with a model
    sampled = llm.generate(prompts[:1], SamplingParams(max_tokens=6, seed=3, logprobs=2))[0]
    assert len(sampled.outputs[0].logprobs) == 6


def test_a_mock_engine_queues_constrained_steps_ahead_alike(model_dir):
    """Structured outputs on the mock runner with async scheduling (its steps' tokens
    read back once the modelled step is over): the answers match the grammar and are
    those of plain stepping."""
    from basis.structured_output import StructuredOutput

    spec = StructuredOutput.choice(["yes", "no", "maybe not"])
    params = SamplingParams(max_tokens=12, temperature=0, structured_output=spec)
    prompts = random_prompts(500, (5, 30, 12), seed=83)
    answers = {}
    for ahead in (False, True):
        llm = LLM(model_dir("tiny-llama"), model_runner="mock", mock_step_ms=2,
                  async_scheduling=ahead)  # fmt: skip
        answers[ahead] = [(o.outputs[0].text, o.outputs[0].finish_reason)
                          for o in llm.generate(prompts, params)]  # fmt: skip
    assert answers[True] == answers[False]
    assert all(text in ("yes", "no", "maybe not") and why == "stop" for text, why in answers[True])


def test_a_mock_engine_refuses_what_it_cannot_model(model_dir):
    with pytest.raises(ValueError, match="model_runner"):
        LLM(model_dir("tiny-llama"), model_runner="fake")
    with pytest.raises(ValueError, match="one rank"):
        LLM(model_dir("tiny-llama"), model_runner="mock", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="mock_step_ms"):
        LLM(model_dir("tiny-llama"), model_runner="mock", mock_step_ms=-1)


def test_a_mesh_of_mock_workers_streams_and_reports_its_kv_blocks(model_dir):
    """The mesh serves a mock worker's answers as the engine gives them, and the
    worker's KV events reach the scheduler, which places a repeated prompt on it."""
    folder = model_dir("tiny-llama")
    prompt = random_prompts(500, (40,), seed=82)[0]
    want = LLM(folder, model_runner="mock").generate([prompt], GREEDY)[0].outputs[0].text
    spec = MeshSpec(model=str(folder), workers=1, port=0,
                    engine_argv=["--model-runner", "mock", "--mock-step-ms", "2"])  # fmt: skip
    with Mesh(spec) as mesh:
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        first = httpx.post(f"{mesh.url}/v1/completions", json=body, timeout=60).json()
        assert first["choices"][0]["text"] == want
        assert wait_indexed(mesh, 2)  # the prompt's two full blocks, on one worker
        again = httpx.post(f"{mesh.url}/v1/completions", json=body, timeout=60).json()
        assert again["choices"][0]["text"] == want
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


def test_the_mesh_overhead_benchmark_runs_on_the_cpu(tmp_path):
    """bench/mesh_overhead.py's dry run: the gRPC and HTTP floors were timed, every stream got
    all its tokens, alone and through the mesh, and each service's CPU use was read."""
    from bench.mesh_overhead import main

    out = tmp_path / "overhead.json"
    results = main(["--concurrency", "1,4", "--rounds", "2", "--step-ms", "2",
                    "--output-len", "8", "--long-output-len", "24",
                    "--min-requests", "0", "--floor-calls", "20", "--out", str(out)])  # fmt: skip
    assert 0 < results["grpc_floor"]["busy_p50_ms"] < 1000
    floor = results["http_floor"]
    assert 0 < floor["busy_p50_ms"] <= floor["busy_p99_ms"] < 1000 and floor["idle_p50_ms"] > 0
    assert [r["concurrency"] for r in results["by_concurrency"]] == [1, 4]
    for row in results["by_concurrency"]:
        assert row["engine"]["requests"] == row["mesh"]["requests"] == 2 * row["concurrency"]
        assert row["mesh"]["ttft_p50_ms"] > 0 and row["cores"]["gateway"] > 0
        assert row["cpu_us_per_token"]["gateway"] > 0
        # the split at two lengths gives back the CPU a request of the short length
        for name, us in row["cpu_us_per_token"].items():
            fixed = row["cpu_ms_per_request_fixed"][name] * 1e3
            assert fixed + 8 * row["cpu_us_per_extra_token"][name] == pytest.approx(8 * us)
        # the engine alone is split too, and the mesh's figure is beyond it
        slope = row["cpu_us_per_extra_token"]
        services = sum(slope[n] for n in row["cpu_us_per_token"])
        assert row["mesh_added_us_per_extra_token"] == pytest.approx(
            services - slope["engine alone"]
        )
    assert json.loads(out.read_text())["by_concurrency"][1]["concurrency"] == 4
