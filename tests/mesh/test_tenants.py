"""Tenants and keys on a mesh of two gateways sharing their tenants' limits through
Redis: a tenant over its limit gets 429 with Retry-After while another is served;
one budget across both gateways; keys reloaded on SIGHUP; keys in no log or span."""

from __future__ import annotations

import json
import signal
import threading
import time

import grpc
import httpx
import pytest
from redis_server import RedisServer

from bench.otlp_receiver import OtlpReceiver
from proto.yinian.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from yinian.mesh import Mesh, MeshSpec

MODEL = "tiny-llama"
# Distinctive keys: none of these strings may appear in any log or span.
KEY_A, KEY_B = "sk-flood-7c1d9e3a5f0b", "sk-calm-2b8e6f4d1a9c"
KEY_SHARED, KEY_OLD = "sk-shared-5e3c7a9d2f1b", "sk-old-9a4f2c8e6b1d"
KEY_NEW, KEY_WRONG = "sk-new-3d7b1f9c5e2a", "sk-wrong-6f2a8d4c9e7b"
LIMITS = {
    "alpha": {"requests_per_minute": 60, "burst": 4, "max_concurrent": 2},
    "shared": {"requests_per_minute": 1, "burst": 6},
}
# one per process a request crosses (the gateway places it: no call to the scheduler)
LAST_SPANS = {"gateway.request", "worker.generate"}
BODY = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def tenant_mesh(model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tenants")
    keys, limits = folder / "keys.txt", folder / "limits.json"
    keys.write_text(f"{KEY_A} alpha\n{KEY_B} beta\n{KEY_SHARED} shared\n{KEY_OLD} gamma\n")
    limits.write_text(json.dumps(LIMITS))
    redis = RedisServer().start()
    receiver = OtlpReceiver().start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100",
           "OTEL_EXPORTER_OTLP_INSECURE": "true"}  # fmt: skip
    spec = MeshSpec(
        model=str(model_dir(MODEL)),
        workers=1,
        gateways=2,
        port=0,
        env=env,
        engine_argv=["--device", "cpu"],
        gateway_argv=["--api-keys", str(keys), "--tenant-limits", str(limits),
                      "--redis-url", redis.url],
    )  # fmt: skip
    try:
        with Mesh(spec) as mesh:
            yield mesh, keys, receiver
    finally:
        receiver.stop()
        redis.stop()


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_a_tenant_over_its_limit_gets_429_while_another_is_served(tenant_mesh):
    mesh = tenant_mesh[0]
    flood: list[httpx.Response] = []
    calm: list[httpx.Response] = []
    with httpx.Client(base_url=mesh.url, timeout=60) as client:

        def flooder():
            for _ in range(6):
                flood.append(client.post("/v1/completions", json=BODY, headers=auth(KEY_A)))

        threads = [threading.Thread(target=flooder) for _ in range(8)]
        for t in threads:
            t.start()
        for _ in range(8):
            calm.append(client.post("/v1/completions", json=BODY, headers=auth(KEY_B)))
        for t in threads:
            t.join()
        # The connections that carried 429s (and a 401) serve the next requests.
        assert client.post("/v1/completions", json=BODY, headers=auth(KEY_WRONG)).status_code == 401
        assert all(
            client.post("/v1/completions", json=BODY, headers=auth(KEY_B)).status_code == 200
            for _ in range(4)
        )
    assert [r.status_code for r in calm] == [200] * 8
    refused = [r for r in flood if r.status_code == 429]
    assert refused and len(refused) + sum(r.status_code == 200 for r in flood) == len(flood)
    for r in refused:
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == 429


def test_two_gateways_share_one_tenants_budget(tenant_mesh):
    mesh = tenant_mesh[0]
    burst, extra = LIMITS["shared"]["burst"], 4
    statuses = [
        httpx.post(f"{mesh.urls[i % 2]}/v1/completions", json=BODY, headers=auth(KEY_SHARED),
                   timeout=60).status_code
        for i in range(burst + extra)
    ]  # fmt: skip
    assert sorted(statuses) == [200] * burst + [429] * extra, statuses


def test_grpc_requests_are_limited_too(tenant_mesh):
    mesh = tenant_mesh[0]
    _, grpc_port = mesh.gateway_ports[1]
    stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
    request = inference_pb2.CompletionRequest(
        model=MODEL, text="Hello", params=common_pb2.SamplingParams(max_tokens=2)
    )
    ok = stub.Complete(request, metadata=[("authorization", f"Bearer {KEY_B}")], timeout=30)
    assert ok.choices[0].text is not None
    with pytest.raises(grpc.RpcError) as info:  # "shared" spent its budget just above
        stub.Complete(request, metadata=[("authorization", f"Bearer {KEY_SHARED}")], timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_the_key_file_is_read_again_on_sighup(tenant_mesh):
    mesh, keys = tenant_mesh[:2]
    assert httpx.post(f"{mesh.url}/v1/completions", json=BODY, headers=auth(KEY_OLD),
                      timeout=60).status_code == 200  # fmt: skip
    keys.write_text(f"{KEY_A} alpha\n{KEY_B} beta\n{KEY_SHARED} shared\n{KEY_NEW} gamma\n")
    for name in ("gateway", "gateway-1"):
        mesh.child(name).proc.send_signal(signal.SIGHUP)
    for url in mesh.urls:
        deadline = time.monotonic() + 10
        while True:
            old = httpx.post(f"{url}/v1/completions", json=BODY, headers=auth(KEY_OLD), timeout=60)
            if old.status_code == 401 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert old.status_code == 401
        new = httpx.post(f"{url}/v1/completions", json=BODY, headers=auth(KEY_NEW), timeout=60)
        assert new.status_code == 200, new.text


def test_keys_appear_in_no_log_and_no_span(tenant_mesh):
    mesh, _, receiver = tenant_mesh
    # Each process exports its spans in the order they end (every 100 ms): once one last
    # request through each gateway has its spans from every service it touched (this mesh
    # has no KV store), every earlier span of those processes is here too.
    last = [httpx.post(f"{url}/v1/completions", json=BODY, headers=auth(KEY_B),
                       timeout=60).json()["id"] for url in mesh.urls]  # fmt: skip
    deadline = time.monotonic() + 10
    while True:
        spans = receiver.snapshot()
        roots = {s.attributes.get("yinian.request_id"): s.trace_id
                 for s in spans if s.name == "gateway.request"}  # fmt: skip
        traced = [{s.name for s in spans if s.trace_id == roots.get(rid)} for rid in last]
        if all(LAST_SPANS <= names for names in traced) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert all(LAST_SPANS <= names for names in traced), traced
    assert any(s.name == "gateway.request" for s in spans)  # the spans are the real ones
    exported = json.dumps([[s.service, s.name, s.attributes] for s in spans], default=str)
    logs = "".join(p.read_text(errors="replace") for p in mesh.log_dir.glob("*.log"))
    assert "READY gateway" in logs  # the logs are the real ones
    for key in (KEY_A, KEY_B, KEY_SHARED, KEY_OLD, KEY_NEW, KEY_WRONG):
        assert key not in exported, key
        assert key not in logs, key
