"""Nothing behind the gateway answers a stranger: a direct call to a worker, the
scheduler or the KV store without the mesh's token is UNAUTHENTICATED (health
checks stay open for probes), and its NATS takes no client without the mesh's
password, while the mesh's own calls go through; with
`insecure_internal` the same calls are served, as `yinian up --insecure-internal`
warns. (Forged blocks in Redis: test_kvstore_mesh.py; the gateway's own limits:
test_gateway_stall.py.)"""

from __future__ import annotations

import argparse
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
from yinian.up import banner


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
        assert "@" not in mesh.nats_url  # no login: NATS takes anyone too
        asyncio.run(_connect(mesh.nats_url))
        shown = banner(mesh, _UP_ARGS)
    assert chunks and chunks[-1].finish_reason, chunks[-1:]
    assert "WARNING:        --insecure-internal: the services take calls from anyone" in shown


def test_the_banner_warns_only_when_the_mesh_is_open(guarded_mesh):
    assert "WARNING" not in banner(guarded_mesh, _UP_ARGS)
    password = guarded_mesh.nats_url.split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
    assert password and password not in banner(guarded_mesh, _UP_ARGS)  # masked


_UP_ARGS = argparse.Namespace(served_model_name=None, host="127.0.0.1")


async def _connect(url: str) -> None:
    client = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0,
                                allow_reconnect=False)  # fmt: skip
    await client.close()


def test_nats_refuses_a_client_without_the_mesh_password(guarded_mesh):
    bare = "nats://" + guarded_mesh.nats_url.rsplit("@", 1)[-1]
    assert bare != guarded_mesh.nats_url  # the mesh's own URL carries its login

    with pytest.raises(Exception, match="(?i)authorization"):
        asyncio.run(_connect(bare))
    asyncio.run(_connect(guarded_mesh.nats_url))
