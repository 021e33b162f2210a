"""A dying worker in a disaggregated mesh: streams migrate without repeating
or losing a token, leases are released, a dead prefill worker costs time but
no request."""

from __future__ import annotations

import time

import httpx
from prompts import greedy_texts, random_prompts

from bench.gpu import pd_kill
from yinian.mesh import Mesh, MeshSpec
from yinian.mesh_probe import metric_sum

MAX_TOKENS = 300


def spec(model_dir, **kw) -> MeshSpec:
    return MeshSpec(
        model=str(model_dir("tiny-llama")),
        workers=0,
        prefill=1,
        decode=2,
        port=0,
        engine_argv=["--device", "cpu"],
        scheduler_argv=["--disagg-min-tokens", "1", "--heartbeat-timeout", "1.5"],
        **kw,
    )


def run_streams(mesh, prompts, kill: str, wait_started: int, delay: float = 0.0):
    results, elapsed, hung = pd_kill.run_streams(
        mesh, "tiny-llama", prompts, MAX_TOKENS, kill, wait_started, delay
    )
    assert not hung, "a stream hung after the kill"
    return {i: (r["text"], r["error"]) for i, r in enumerate(results)}, elapsed


def test_decode_worker_death_migrates_streams(model_dir):
    prompts = random_prompts(500, [20 + 7 * i for i in range(32)], seed=101)
    expected = greedy_texts(model_dir("tiny-llama"), prompts, MAX_TOKENS)
    with Mesh(spec(model_dir, role_argv={"decode": ["--kv-lease-seconds", "3"]})) as mesh:
        results, elapsed = run_streams(mesh, prompts, "decode-0", wait_started=8)
        for i in range(len(prompts)):
            text, error = results[i]
            assert error is None, f"stream {i}: {error}"  # within the migration budget
            assert text == expected[i], f"stream {i} differs from a clean run"
        assert elapsed < 120
        # The prefill worker's blocks held for the dead decode worker are released
        # once their leases run out.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if metric_sum(mesh, "yinian:kv_cache_usage_ratio", role="prefill") == 0:
                break
            time.sleep(0.5)
        assert metric_sum(mesh, "yinian:kv_cache_usage_ratio", role="prefill") == 0


def test_prefill_worker_death_costs_no_request(model_dir):
    prompts = random_prompts(500, [900 + 37 * i for i in range(16)], seed=102)
    expected = greedy_texts(model_dir("tiny-llama"), prompts, MAX_TOKENS)
    with Mesh(spec(model_dir)) as mesh:
        # Killed while the prompts are still being prefilled (or about to be).
        results, _ = run_streams(mesh, prompts, "prefill-0", wait_started=0, delay=0.3)
        for i in range(len(prompts)):
            text, error = results[i]
            if error is None:
                assert text == expected[i]
            else:  # a clear cause, never a silent hang
                assert error
        assert sum(1 for t, e in results.values() if e is None) == len(prompts)
        assert metric_sum(mesh, "yinian:kv_handoff_fallbacks_total") >= 1
        after = httpx.post(
            f"{mesh.url}/v1/completions",
            timeout=60,
            json={"model": "tiny-llama", "prompt": prompts[0], "max_tokens": 4, "temperature": 0},
        )
        assert after.status_code == 200
