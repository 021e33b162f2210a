"""Every accepted request ends with its output or an error, never a 200 stream that
just stops. A worker that breaks its streams on purpose (tests/faulty_worker.py:
registered with the real scheduler, reached by the real gateway) is placed first;
a real worker stands by to take over."""

from __future__ import annotations

import json
import os
import sys
import time

import grpc
import httpx
import pytest
from paths import TESTS

from proto.yinian.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from yinian.children import launch, wait_ready
from yinian.mesh import Mesh, MeshSpec, _bound_gateway
from yinian.mesh_probe import list_workers

MODEL = "tiny-llama"
HELPER = TESTS / "faulty_worker.py"


@pytest.fixture(scope="module")
def faulty_mesh(model_dir, tmp_path_factory):
    control = tmp_path_factory.mktemp("faulty") / "control"
    control.write_text("finish")
    # workers=0, max_workers=1: the real worker, started below, gets its NATS login
    # port 0: any free port, read back from the gateway (8000 may be another test's)
    spec = MeshSpec(model=str(model_dir(MODEL)), workers=0, max_workers=1, gateways=0,
                    port=0, engine_argv=["--device", "cpu"])  # fmt: skip
    mesh = Mesh(spec).start()  # NATS and the scheduler
    try:
        deadline = time.monotonic() + 120
        faulty = mesh._add(launch(
            "faulty-0",
            [sys.executable, str(HELPER), "--scheduler", mesh.scheduler_address,
             "--nats-url", mesh.nats_url, "--control", str(control)],
            dict(os.environ), mesh.log_dir / "faulty-0.log",
        ))  # fmt: skip
        wait_ready([faulty], deadline)  # registered first: placement prefers it on ties
        worker = mesh._spawn("worker-0", "services.decode",
                             mesh.worker_args("worker-0", "colocated"), "colocated")  # fmt: skip
        mesh.spec.gateways = 1
        gateway = mesh._spawn_gateway(0)
        wait_ready([worker, gateway], deadline)
        mesh.gateway_ports = [_bound_gateway(gateway)]
        mesh._wait_healthy(mesh.url, deadline, None)
        yield mesh, control
    finally:
        mesh.stop()


def settle(mesh) -> None:
    """Until both workers have reported their load since this was called (the last
    request has ended): then they tie, and the faulty worker, registered first, is
    placed."""
    called, deadline = time.monotonic(), time.monotonic() + 10
    while time.monotonic() < deadline:
        since = time.monotonic() - called  # before the call: a report older than `called` fails
        workers = list_workers(mesh)
        if len(workers) == 2 and all(w.seconds_since_report < since for w in workers):
            return
        time.sleep(0.05)
    seen = [(w.info.worker_id, round(w.seconds_since_report, 2)) for w in workers]
    raise AssertionError(f"no fresh load report in 10 s: {seen}, {since:.2f} s")


def events(client: httpx.Client, mesh, body: dict) -> list:
    settle(mesh)
    with client.stream("POST", f"{mesh.url}/v1/completions", json=body | {"stream": True}) as resp:
        assert resp.status_code == 200
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines
    return [json.loads(line) for line in lines[:-1]]


def body(max_tokens: int = 8, **extra) -> dict:
    return {"model": MODEL, "prompt": "Hello there", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True,
            "stream_options": None, **extra}  # fmt: skip


def whole_stream(chunks: list) -> tuple[int, list]:
    """(tokens in the usage chunk, finish reasons) of a completed stream."""
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert not any("error" in c for c in chunks), chunks
    return usage[-1]["completion_tokens"], [f for f in finishes if f]


@pytest.mark.parametrize("mode", ["close 3", "close 0"])
def test_a_stream_closed_without_its_last_token_is_moved_on(faulty_mesh, mode):
    mesh, control = faulty_mesh
    control.write_text(mode)  # the faulty worker ends its stream with OK, early
    with httpx.Client(timeout=60) as client:
        streamed = events(client, mesh, body(stream_options={"include_usage": True}))
        assert whole_stream(streamed) == (8, ["length"])
        settle(mesh)
        whole = client.post(f"{mesh.url}/v1/completions", json=body())
        assert whole.status_code == 200, whole.text
        assert whole.json()["usage"]["completion_tokens"] == 8
        assert whole.json()["choices"][0]["finish_reason"] == "length"


def test_a_stream_that_cannot_move_ends_with_an_error_chunk(faulty_mesh):
    mesh, control = faulty_mesh
    control.write_text("close 3")  # n=2: a request of several outputs is never migrated
    with httpx.Client(timeout=60) as client:
        streamed = events(client, mesh, body(n=2))
        assert streamed[-1]["error"]["code"] == 503, streamed[-1]
        assert not any(c.get("choices", [{}])[0].get("finish_reason") for c in streamed[:-1])
        settle(mesh)
        whole = client.post(f"{mesh.url}/v1/completions", json=body(n=2))
        assert whole.status_code == 503 and whole.json()["error"]["message"], whole.text
        # the connection that carried the failed stream serves the next request
        control.write_text("finish")
        settle(mesh)
        again = client.post(f"{mesh.url}/v1/completions", json=body(n=2))
        assert again.status_code == 200 and len(again.json()["choices"]) == 2
    control.write_text("close 3")
    stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(f"127.0.0.1:{mesh.grpc_port}"))
    request = inference_pb2.CompletionRequest(
        model=MODEL, text="Hello", params=common_pb2.SamplingParams(max_tokens=8, n=2)
    )
    settle(mesh)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.CompleteStream(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_worker_killed_mid_stream_is_replaced(faulty_mesh):
    mesh, control = faulty_mesh
    control.write_text("die 3")  # last: the faulty worker is gone after this
    with httpx.Client(timeout=60) as client:
        streamed = events(client, mesh, body(stream_options={"include_usage": True}))
    assert whole_stream(streamed) == (8, ["length"])
    assert mesh.child("faulty-0").proc.wait(timeout=10) == -9
