"""Prefill/decode disaggregation through the whole mesh: 1 prefill + 2 decode
workers over the tcp transport, real processes, real NATS."""

from __future__ import annotations

import time

import httpx
import pytest
from prompts import random_prompts

from basis import preload_client
from bench.otlp_receiver import OtlpReceiver
from engine import LLM, SamplingParams
from yinian.mesh import Mesh, MeshSpec
from yinian.mesh_probe import index_sizes, metric_sum, wait_indexed, workers_by_role


@pytest.fixture(scope="module")
def pd(model_dir):
    receiver = OtlpReceiver().start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    spec = MeshSpec(
        model=str(model_dir("tiny-llama")),
        workers=0,
        prefill=1,
        decode=2,
        port=0,
        env=env,
        engine_argv=["--device", "cpu"],
        scheduler_argv=["--disagg-min-tokens", "1"],
        gpus=["0", "1"],  # inert on CPU; checked as what each worker process was given
    )
    # each a fresh process: what each was given is read from its /proc environ below
    with preload_client.preloading(False):
        mesh = Mesh(spec).start()
    try:
        yield mesh, receiver
    finally:
        mesh.stop()
    receiver.stop()


def complete(mesh, prompt, max_tokens=8):
    resp = httpx.post(
        f"{mesh.url}/v1/completions",
        timeout=120,
        json={
            "model": "tiny-llama",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_split_mesh_equals_engine(pd, model_dir):
    mesh, _ = pd
    prompts = random_prompts(500, (1, 17, 100, 700, 3000), seed=91)
    expected = LLM(model_dir("tiny-llama"), device="cpu").generate(
        prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )
    before = metric_sum(mesh, "yinian:kv_transfer_blocks_total")
    for prompt, exp in zip(prompts, expected):
        got = complete(mesh, prompt)
        assert got["choices"][0]["text"] == exp.outputs[0].text, len(prompt)
    moved = metric_sum(mesh, "yinian:kv_transfer_blocks_total") - before
    assert moved == sum(-(-len(p) // 16) for p in prompts)  # every prompt was handed over
    assert metric_sum(mesh, "yinian:kv_handoff_fallbacks_total") == 0


def test_workers_are_spread_over_the_gpus_given(pd):
    mesh, _ = pd
    seen = {}
    for name in ("prefill-0", "decode-0", "decode-1"):
        environ = open(f"/proc/{mesh.child(name).proc.pid}/environ", "rb").read().split(b"\0")
        seen[name] = next(
            e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"CUDA_VISIBLE_DEVICES=")
        )
    assert seen == {"prefill-0": "0,1", "decode-0": "1,0", "decode-1": "0,1"}


def test_shared_prefix_moves_only_missing_blocks(pd):
    mesh, _ = pd
    prefix, a, b = random_prompts(500, (320, 40, 50), seed=92)
    decoders = {w.worker_id for w in workers_by_role(mesh)["decode"]}
    before = index_sizes(mesh)
    complete(mesh, prefix + a)
    # the decode worker's KV events reach the scheduler
    assert wait_indexed(mesh, (320 + 40) // 16, before, among=decoders), index_sizes(mesh)
    moved = metric_sum(mesh, "yinian:kv_transfer_blocks_total")
    skipped = metric_sum(mesh, "yinian:kv_skipped_blocks_total")
    complete(mesh, prefix + b)
    assert metric_sum(mesh, "yinian:kv_skipped_blocks_total") - skipped == 20
    assert metric_sum(mesh, "yinian:kv_transfer_blocks_total") - moved == -(-370 // 16) - 20


def test_trace_shows_placement_prefill_transfer_and_decode(pd):
    mesh, receiver = pd
    rid = complete(mesh, random_prompts(500, (90,), seed=93)[0], max_tokens=4)["id"]
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        spans = receiver.snapshot()
        root = next(
            (
                s
                for s in spans
                if s.attributes.get("yinian.request_id") == rid and s.name == "gateway.request"
            ),
            None,
        )
        mine = [s for s in spans if root and s.trace_id == root.trace_id]
        if {"prefill.handoff", "kv_transfer", "decode"} <= {s.name for s in mine}:
            break
        time.sleep(0.2)
    by_id = {s.span_id: s for s in mine}
    names = {s.name: s for s in mine}
    assert {
        "placement",
        "worker.generate",
        "prefill",
        "kv_transfer",
        "prefill.handoff",
        "decode",
    } <= set(names)
    assert {s.service for s in mine} >= {"yinian-gateway", "yinian-decode", "yinian-prefill"}
    # the gateway placed it (and paired the prefill worker): no call to the scheduler
    assert names["placement"].attributes["yinian.placed_by"] == "gateway"
    assert "yinian-scheduler" not in {s.service for s in mine}
    assert by_id[names["kv_transfer"].parent_id].name == "worker.generate"
    handoff = names["prefill.handoff"]
    assert by_id[handoff.parent_id].service == "yinian-decode"
    assert names["kv_transfer"].attributes["yinian.kv_blocks"] == -(-90 // 16)
    assert names["kv_transfer"].attributes["yinian.transport"] == "tcp"
