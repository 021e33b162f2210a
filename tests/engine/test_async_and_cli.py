"""The asyncio streaming wrapper and the `yinian` command line."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
from prompts import random_prompts

from engine import LLM, AsyncLLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def async_llm(model_dir):
    llm = AsyncLLM.from_model(model_dir("tiny-llama"), dtype="float32", device="cpu")
    yield llm
    llm.shutdown()


def test_concurrent_streams_equal_offline(async_llm, model_dir):
    prompts = random_prompts(512, (3, 40, 17, 90, 1, 64, 33, 8), seed=41)
    expected = [
        o.outputs[0].token_ids
        for o in LLM(model_dir("tiny-llama"), dtype="float32", device="cpu").generate(
            prompts, GREEDY
        )
    ]

    async def one(i, prompt):
        seen, last = [], None
        async for out in async_llm.generate(prompt, GREEDY, request_id=f"r{i}"):
            seen.append(len(out.outputs[0].token_ids))
            last = out
        assert seen == sorted(seen) and last.finished
        return last.outputs[0].token_ids

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    assert asyncio.run(main()) == expected


def test_leaving_the_stream_aborts_the_request(async_llm):
    async def main():
        stream = async_llm.generate(
            [1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True), request_id="walk-away"
        )
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await stream.aclose()
        for _ in range(100):
            await asyncio.sleep(0.02)
            stats = async_llm.get_stats()
            if stats["num_requests_running"] == 0 and stats["kv_blocks_used"] == 0:
                return True
        return False

    assert asyncio.run(main())


def test_the_engine_counts_its_steps_and_where_its_thread_spent_the_time(async_llm):
    """A user diagnosing a slow worker reads how many steps ran, how long the engine
    thread waited for them and what else it did (the worker exports these)."""

    async def run(tokens: int) -> dict:
        before = async_llm.get_stats()
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        async for _ in async_llm.generate([5, 6, 7, 8], params, request_id=f"count-{tokens}"):
            pass
        for _ in range(50):  # the snapshot is refreshed at most every 50 ms
            await asyncio.sleep(0.06)
            after = async_llm.get_stats()
            if after["num_steps"] - before["num_steps"] >= tokens:
                break
        return before, after

    before, after = asyncio.run(run(9))
    # one prefill step sampling the first token, then one decode step per token after it
    assert after["num_steps"] - before["num_steps"] == 9
    assert after["step_wait_seconds"] >= before["step_wait_seconds"]
    assert after["steps_device_timed"] == before["steps_device_timed"] == 0  # CPU: none timed
    spent = {p: after["engine_thread_seconds"][p] - before["engine_thread_seconds"][p]
             for p in after["engine_thread_seconds"]}  # fmt: skip
    assert set(spent) == {"step", "calls", "requests", "housekeeping", "publish", "idle"}
    assert spent["step"] > 0 and spent["requests"] > 0 and spent["idle"] > 0
    assert all(v >= 0 for v in spent.values())


def test_bad_request_raises_in_the_caller(async_llm):
    async def main():
        with pytest.raises(ValueError):
            async for _ in async_llm.generate([], GREEDY, request_id="bad"):
                pass
        outs = [o async for o in async_llm.generate([4, 5], GREEDY, request_id="good")]
        return outs[-1]

    assert asyncio.run(main()).finished


def _yinian(*args, env_extra=None, timeout=300):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "yinian", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_cli_make_model_and_generate(tmp_path):
    made = _yinian(
        "make-model", "--preset", "tiny-moe", "--out", str(tmp_path / "moe"), "--seed", "7"
    )
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "moe" / "model.safetensors").is_file()
    run = _yinian(
        "generate",
        "--model",
        str(tmp_path / "moe"),
        "--prompt",
        "Hello",
        "--prompt",
        "Bye",
        "--max-tokens",
        "5",
        "--device",
        "cpu",
    )
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["Hello", "Bye"]
    assert all(len(r["token_ids"]) <= 5 for r in records)


def test_cli_generate_without_model_uses_the_default_one(tmp_path):
    run = _yinian("generate", "--max-tokens", "4", env_extra={"YINIAN_CACHE": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    assert not (tmp_path / "models").exists()  # the committed default model, nothing made
    assert len(run.stdout.splitlines()) == 2


def test_cli_reports_bad_input_clearly(tmp_path):
    run = _yinian("generate", "--max-tokens", "0", env_extra={"YINIAN_CACHE": str(tmp_path)})
    assert run.returncode == 2 and "max_tokens must be >= 1" in run.stderr
    # the sampling settings are checked before any model is looked for or loaded
    run = _yinian("generate", "--model", str(tmp_path / "none"), "--temperature", "-1")
    assert run.returncode == 2 and "temperature" in run.stderr, run.stderr
    run = _yinian("generate", "--speculative-method", "medusa")
    assert run.returncode == 2 and "--speculative-method" in run.stderr, run.stderr
    bad = _yinian("make-model", "--preset", "nope", "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and "unknown preset" in bad.stderr
