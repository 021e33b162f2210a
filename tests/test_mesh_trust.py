"""Nothing behind the gateway answers a stranger: a direct call to a worker, the
scheduler or the KV store without the mesh's token is UNAUTHENTICATED (health
checks stay open for probes), and its NATS takes no client without the mesh's
password, while the mesh's own calls go through; with
`insecure_internal` the same calls are served, as `yinian up --insecure-internal`
warns. (Forged blocks in Redis: test_kvstore_mesh.py; the gateway's own limits:
test_gateway_stall.py.)"""

from __future__ import annotations

import asyncio

import grpc
import nats
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.yinian.v1 import (
    common_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from yinian.default_model import ensure_default_model
from yinian.mesh import Mesh, MeshSpec
from yinian.mesh_probe import list_workers


def _generate(address: str) -> list:
    stub = worker_pb2_grpc.DecodeStub(grpc.insecure_channel(address))
    request = worker_pb2.GenerateRequest(
        request_id="probe", prompt_token_ids=[1, 2, 3], tenant="tenantA",
        params=common_pb2.SamplingParams(max_tokens=1500),
    )  # fmt: skip
    return list(stub.Generate(request, timeout=30))


def test_direct_calls_without_the_mesh_token_are_refused(guarded_mesh):
    worker = list_workers(guarded_mesh)[0].info  # the test's own calls carry the token
    with pytest.raises(grpc.RpcError) as err:
        _generate(worker.address)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    scheduler = scheduler_pb2_grpc.SchedulerStub(
        grpc.insecure_channel(guarded_mesh.scheduler_address)
    )
    for call, request in [
        (scheduler.ListWorkers, scheduler_pb2.ListWorkersRequest()),
        (scheduler.Place, scheduler_pb2.PlaceRequest(request_id="x", prompt_tokens=3)),
        (scheduler.Register, scheduler_pb2.WorkerInfo(worker_id="fake", address="127.0.0.1:1")),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, call
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(worker.address))
    answer = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    assert [w.info.worker_id for w in list_workers(guarded_mesh)] == [worker.worker_id]


def test_insecure_internal_serves_strangers():
    spec = MeshSpec(model=str(ensure_default_model()), workers=1, port=0,
                    engine_argv=["--device", "cpu", "--max-model-len", "256"],
                    gateway_argv=["--max-model-len", "256"], insecure_internal=True)  # fmt: skip
    with Mesh(spec) as mesh:
        worker = list_workers(mesh)[0].info
        chunks = _generate(worker.address)
    assert chunks and chunks[-1].finish_reason, chunks[-1:]


def test_nats_refuses_a_client_without_the_mesh_password(guarded_mesh):
    bare = "nats://" + guarded_mesh.nats_url.rsplit("@", 1)[-1]
    assert bare != guarded_mesh.nats_url  # the mesh's own URL carries its login

    async def connect(url: str) -> None:
        client = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0,
                                    allow_reconnect=False)  # fmt: skip
        await client.close()

    with pytest.raises(Exception, match="(?i)authorization"):
        asyncio.run(connect(bare))
    asyncio.run(connect(guarded_mesh.nats_url))
