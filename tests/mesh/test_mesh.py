"""The mesh as users meet it: real processes on loopback, real NATS, through
the OpenAI REST API, the official client and gRPC."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
from prompts import random_prompts

from basis.block_hash import hash_prompt_blocks
from engine import LLM, SamplingParams
from proto.yinian.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
)
from yinian.mesh import Mesh, MeshSpec
from yinian.mesh_probe import (
    gateway_metric,
    index_sizes,
    list_workers,
    scheduler_metric,
    wait_held,
    wait_indexed,
    worker_metric,
)

KEY, OTHER_KEY = "sk-test-alpha", "sk-test-beta"


@pytest.fixture(scope="module")
def mesh(model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{KEY} alpha\n{OTHER_KEY} beta\n")
    spec = MeshSpec(
        model=str(model_dir("tiny-llama")),
        workers=2,
        port=0,
        gateway_argv=["--api-keys", str(keys)],
        engine_argv=["--device", "cpu"],
    )
    with Mesh(spec) as m:
        yield m


@pytest.fixture(scope="module")
def reference(model_dir):
    return LLM(model_dir("tiny-llama"), device="cpu")


def post(mesh, path, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{mesh.url}{path}", json=body, headers=headers, timeout=60, **kw)


def sse_events(mesh, path, body):
    with httpx.stream(
        "POST",
        f"{mesh.url}{path}",
        json=body,
        timeout=60,
        headers={"Authorization": f"Bearer {KEY}"},
    ) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_completions_equal_engine(mesh, reference):
    prompts = ["The quick brown fox", "Hello", "A longer prompt about the mesh and its parts"]
    expected = reference.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    for prompt, exp in zip(prompts, expected):
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 12, "temperature": 0}
        resp = post(mesh, "/v1/completions", body)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["text"] == exp.outputs[0].text
        assert choice["finish_reason"] == exp.outputs[0].finish_reason
        events = sse_events(mesh, "/v1/completions", dict(body, stream=True))
        assert "".join(e["choices"][0]["text"] for e in events) == exp.outputs[0].text
        assert events[-1]["choices"][0]["finish_reason"] == exp.outputs[0].finish_reason


def test_token_id_prompts_equal_engine(mesh, reference):
    prompts = random_prompts(500, (1, 17, 64), seed=61)
    expected = reference.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    resp = post(
        mesh,
        "/v1/completions",
        {"model": "tiny-llama", "prompt": prompts, "max_tokens": 8, "temperature": 0},
    )
    assert resp.status_code == 200, resp.text
    texts = [c["text"] for c in sorted(resp.json()["choices"], key=lambda c: c["index"])]
    assert texts == [e.outputs[0].text for e in expected]
    assert resp.json()["usage"]["prompt_tokens"] == 1 + 17 + 64


def test_chat_equals_engine(mesh, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    ids = reference.engine.tokenizer.encode_chat(messages)
    exp = reference.generate([ids], SamplingParams(max_tokens=10, temperature=0))[0]
    body = {"model": "tiny-llama", "messages": messages, "max_tokens": 10, "temperature": 0}
    resp = post(mesh, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == exp.outputs[0].text
    events = sse_events(mesh, "/v1/chat/completions", dict(body, stream=True))
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == exp.outputs[0].text


def test_openai_client(mesh, reference):
    client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key=KEY)
    assert [m.id for m in client.models.list()] == ["tiny-llama"]
    done = client.completions.create(
        model="tiny-llama", prompt="Once upon", max_tokens=6, temperature=0, n=2, logprobs=2
    )
    assert len(done.choices) == 2 and done.choices[0].text == done.choices[1].text
    assert len(done.choices[0].logprobs.tokens) == 6
    assert all(len(t) == 2 for t in done.choices[0].logprobs.top_logprobs)
    assert done.usage.completion_tokens == 12

    hi = dict(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    chat = client.chat.completions.create(**hi, temperature=0, logprobs=True, top_logprobs=3)
    lp = chat.choices[0].logprobs.content
    assert len(lp) == 5 and all(len(e.top_logprobs) == 3 for e in lp)

    stream = client.chat.completions.create(
        **hi, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content
    # continuous_usage_stats (as benchmark clients send it): every chunk counts so far
    options = {"include_usage": True, "continuous_usage_stats": True}
    counted = list(client.chat.completions.create(
        **hi, temperature=0, stream=True, stream_options=options, extra_body={"ignore_eos": True}
    ))  # fmt: skip
    prompt_tokens = {c.usage.prompt_tokens for c in counted}
    assert prompt_tokens == {chat.usage.prompt_tokens}, prompt_tokens
    made = [c.usage.completion_tokens for c in counted]
    assert made == sorted(made) and made[0] == 0 and made[-1] == 5 and len(set(made)) > 2, made

    free = client.completions.create(
        model="tiny-llama", prompt="The quick brown fox", max_tokens=16, temperature=0
    )
    stop = free.choices[0].text[4:7]
    cut = client.completions.create(
        model="tiny-llama", prompt="The quick brown fox", max_tokens=16, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == free.choices[0].text[: free.choices[0].text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_concurrent_streams_spread_over_both_workers(mesh):
    client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key=KEY, max_retries=0)

    def one(i):
        stream = client.completions.create(
            model="tiny-llama",
            prompt=f"Request number {i}",
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join(c.choices[0].text for c in stream if c.choices)

    with ThreadPoolExecutor(64) as pool:
        texts = list(pool.map(one, range(64)))
    assert len(texts) == 64 and all(texts)
    counts = worker_request_counts(mesh)
    assert len(counts) == 2 and all(c >= 8 for c in counts.values()), counts


def worker_request_counts(mesh) -> dict[str, float]:
    return worker_metric(mesh, "yinian:worker_requests_total")


BAD = [
    ("malformed json", "/v1/completions", b"{not json", 400),
    ("unknown model", "/v1/completions", {"model": "gpt-x", "prompt": "hi"}, 404),
    (
        "negative max_tokens",
        "/v1/completions",
        {"model": "tiny-llama", "prompt": "hi", "max_tokens": -1},
        400,
    ),
    (
        "absurd max_tokens",
        "/v1/completions",
        {"model": "tiny-llama", "prompt": "hi", "max_tokens": 10**9},
        400,
    ),
    (
        "prompt over context",
        "/v1/completions",
        {"model": "tiny-llama", "prompt": [7] * 5000, "max_tokens": 1},
        400,
    ),
    (
        "wrong type",
        "/v1/completions",
        {"model": "tiny-llama", "prompt": "hi", "temperature": "hot"},
        400,
    ),
    ("bad top_p", "/v1/completions", {"model": "tiny-llama", "prompt": "hi", "top_p": 3}, 400),
    ("empty messages", "/v1/chat/completions", {"model": "tiny-llama", "messages": []}, 400),
    ("missing prompt", "/v1/completions", {"model": "tiny-llama"}, 400),
]


@pytest.mark.parametrize(("name", "path", "body", "status"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error(mesh, name, path, body, status):
    if isinstance(body, bytes):
        resp = httpx.post(
            f"{mesh.url}{path}",
            content=body,
            timeout=30,
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        )
    else:
        resp = post(mesh, path, body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["message"] and error["type"] and error["code"] == status
    ok = post(mesh, "/v1/completions", {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_missing_or_wrong_key_is_401(mesh, key):
    resp = post(mesh, "/v1/completions", {"model": "tiny-llama", "prompt": "hi"}, key=key)
    assert resp.status_code == 401
    assert resp.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{mesh.url}/v1/models", timeout=10).status_code == 401


def test_tenants_do_not_share_prefix_cache(mesh):
    prompt = list(range(3, 200))
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 1}
    indexed = index_sizes(mesh)
    first = post(mesh, "/v1/completions", body, key=KEY).json()
    # the worker's KV events reach the scheduler asynchronously: this prompt's 12 full
    # blocks, by their hashes in the tenant's namespace (a count could be another
    # request's late batch)
    holder = wait_held(mesh, hash_prompt_blocks(prompt, 16, "alpha"))
    assert holder, (indexed, index_sizes(mesh))
    again = post(mesh, "/v1/completions", body, key=KEY).json()
    other = post(mesh, "/v1/completions", body, key=OTHER_KEY).json()
    cached = lambda r: r["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
    # KV-aware placement found it (a failure says what the scheduler saw: seen once)
    assert cached(first) == 0 and cached(again) >= 192, [
        (
            w.info.worker_id,
            w.ready,
            w.seconds_since_report,
            w.num_requests_running,
            w.num_requests_waiting,
            w.kv_cache_usage,
        )
        for w in list_workers(mesh)
    ] + [holder, index_sizes(mesh), worker_metric(mesh, "yinian:prefix_cache_hit_tokens")]
    assert cached(other) == 0


def test_grpc_api(mesh, reference):
    exp = reference.generate(["Hello"], SamplingParams(max_tokens=6, temperature=0))[0]
    channel = grpc.insecure_channel(f"127.0.0.1:{mesh.grpc_port}")
    stub = inference_pb2_grpc.InferenceStub(channel)
    md = [("authorization", f"Bearer {KEY}")]
    params = common_pb2.SamplingParams(max_tokens=6, temperature=0)
    resp = stub.Complete(
        inference_pb2.CompletionRequest(model="tiny-llama", text="Hello", params=params),
        metadata=md,
        timeout=30,
    )
    assert resp.choices[0].text == exp.outputs[0].text
    chunks = list(
        stub.CompleteStream(
            inference_pb2.CompletionRequest(model="tiny-llama", text="Hello", params=params),
            metadata=md,
            timeout=30,
        )
    )
    assert "".join(c.text for c in chunks) == exp.outputs[0].text
    assert chunks[-1].usage.completion_tokens == 6
    with pytest.raises(grpc.RpcError) as info:
        stub.Complete(
            inference_pb2.CompletionRequest(
                model="tiny-llama", text="Hello", params=common_pb2.SamplingParams(top_p=7)
            ),
            metadata=md,
            timeout=30,
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:
        stub.ListModels(inference_pb2.ListModelsRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_health_and_metrics(mesh):
    assert httpx.get(f"{mesh.url}/health", timeout=10).status_code == 200
    text = httpx.get(f"{mesh.url}/metrics", timeout=10).text
    for name in (
        "yinian:time_to_first_token_seconds",
        "yinian:e2e_request_latency_seconds",
        "yinian:inter_token_latency_seconds",
    ):
        assert f"{name}_count" in text


def test_workers_export_their_steps_and_engine_thread_time(mesh):
    """Each worker's metrics say how many steps it ran and where its engine thread's
    time went, growing as it serves, and how long each phase of its start took."""

    def steps() -> float:
        return sum(worker_metric(mesh, "yinian:engine_steps", where='kind="all"').values())

    before = steps()
    body = {"model": "tiny-llama", "prompt": "Count the steps", "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    assert post(mesh, "/v1/completions", body).status_code == 200

    def thread(part: str) -> dict[str, float]:
        return worker_metric(mesh, "yinian:engine_thread_seconds", where=f'part="{part}"')

    deadline = time.monotonic() + 10  # reported every 0.5 s, refreshed every second idle
    while time.monotonic() < deadline:
        busy, idle = thread("step"), thread("idle")
        if steps() >= before + 6 and len(idle) == 2 and all(v > 0 for v in idle.values()):
            break
        time.sleep(0.1)
    assert steps() >= before + 6
    assert len(busy) == 2 and sum(busy.values()) > 0, busy
    assert all(v > 0 for v in idle.values()), idle
    # and where each one's start-up went, by phase
    weights = worker_metric(mesh, "yinian:startup_seconds", where='phase="weights"')
    assert len(weights) == 2 and all(v > 0 for v in weights.values()), weights


def test_client_disconnect_cancels_downstream(mesh):
    async def main():
        async with httpx.AsyncClient(timeout=30) as client:
            async with client.stream(
                "POST",
                f"{mesh.url}/v1/completions",
                json={
                    "model": "tiny-llama",
                    "prompt": "hi",
                    "max_tokens": 3000,
                    "stream": True,
                    "ignore_eos": True,
                },
                headers={"Authorization": f"Bearer {KEY}"},
            ) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        break
        for _ in range(100):
            await asyncio.sleep(0.1)
            if all(v == 0 for v in running_requests(mesh).values()):
                return True
        return False

    assert asyncio.run(main())


def running_requests(mesh) -> dict[str, int]:
    return {
        w.info.worker_id: w.num_requests_running + w.num_requests_waiting
        for w in list_workers(mesh)
    }


@pytest.mark.parametrize("placement", ["gateway", "scheduler"])
def test_the_workers_block_size_is_the_gateways_or_it_is_told(model_dir, placement):
    # workers caching blocks of 32, the gateway's --block-size 16 (its default). A gateway
    # placing requests itself hashes prompts in the workers' 32 (it lists them): their
    # prefixes match. One asking the scheduler hashes in 16: no prefix can ever match, so
    # prefix-aware placement is off; the scheduler counts each such placement and says
    # once, in its log, what to set. Either way the requests are served.
    engine = ["--device", "cpu", "--dtype", "float32", "--block-size", "32"]
    spec = MeshSpec(model=str(model_dir("tiny-llama")), workers=1, port=0, engine_argv=engine,
                    gateway_argv=["--placement", placement])  # fmt: skip
    with Mesh(spec) as mesh:
        prompt = "blocks " * 80  # two blocks of 32 at least
        for i in range(2):
            r = httpx.post(f"{mesh.url}/v1/completions", timeout=60, json={
                "model": "tiny-llama", "prompt": prompt, "max_tokens": 2})  # fmt: skip
            assert r.status_code == 200, r.text
            if i == 0:  # the first one's blocks are known (the scheduler's index)
                assert wait_indexed(mesh, 2)
        outcome = 'outcome="block_size_mismatch"'
        if placement == "gateway":
            assert gateway_metric(mesh, "yinian:placements_total", outcome) == 0
            # the second found the first's prefix where it placed it
            assert gateway_metric(mesh, "yinian:placed_prefix_blocks_total", "chosen") >= 2
            return
        assert scheduler_metric(mesh, "yinian:placements_total", outcome) == 2
        log = (mesh.log_dir / "scheduler.log").read_text()
        assert log.count("give the gateway --block-size 32") == 1, log[-2000:]
