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
import os

import grpc
import nats
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.yinian.v1 import (
    common_pb2,
    kvstore_pb2,
    kvstore_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common import mesh_token
from yinian.default_model import ensure_default_model
from yinian.mesh import Mesh, MeshSpec
from yinian.mesh_probe import list_workers
from yinian.up import banner


def _generate(address: str, credential: str = "", max_tokens: int = 1500) -> list:
    stub = worker_pb2_grpc.DecodeStub(grpc.insecure_channel(address))
    request = worker_pb2.GenerateRequest(
        request_id="probe", prompt_token_ids=[1, 2, 3], tenant="tenantA",
        params=common_pb2.SamplingParams(max_tokens=max_tokens),
    )  # fmt: skip
    metadata = [(mesh_token.KEY, credential)] if credential else None
    return list(stub.Generate(request, timeout=30, metadata=metadata))


def _link(address: str, credential: str) -> list:
    """The same request over a link (Decode.Link), until its end."""
    stub = worker_pb2_grpc.DecodeStub(grpc.insecure_channel(address))
    request = worker_pb2.GenerateRequest(
        request_id="probe-link", prompt_token_ids=[1, 2, 3], tenant="tenantA",
        params=common_pb2.SamplingParams(max_tokens=2),
    )  # fmt: skip
    call = stub.Link(iter([worker_pb2.LinkUp(request=request)]), timeout=30,
                     metadata=[(mesh_token.KEY, credential)])  # fmt: skip
    downs = []
    for down in call:
        downs.append(down)
        if down.ends:
            call.cancel()
            return downs
    return downs


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


def test_a_service_of_the_mesh_calls_only_what_its_kind_may(guarded_mesh):
    """Each service holds its own credential: a worker cannot probe another tenant's
    cache through a worker's Generate or Link (only the gateway names tenants), register
    another worker or place requests; the gateway cannot register a worker; a
    credential with a wrong secret is a stranger's."""
    mine = {n: guarded_mesh.child(n).env[mesh_token.ENV] for n in ("worker-0", "gateway")}
    assert mine["worker-0"].startswith("worker-0.") and mine["gateway"].startswith("gateway.")
    worker = list_workers(guarded_mesh)[0].info
    scheduler = scheduler_pb2_grpc.SchedulerStub(
        grpc.insecure_channel(guarded_mesh.scheduler_address)
    )

    def code(call, request, credential: str):
        try:
            call(request, timeout=10, metadata=[(mesh_token.KEY, credential)])
        except grpc.RpcError as err:
            return err.code()
        return grpc.StatusCode.OK

    fake = scheduler_pb2.WorkerInfo(worker_id="worker-1", address="127.0.0.1:1")
    denied, ok = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OK
    assert code(scheduler.Register, fake, mine["worker-0"]) == denied  # another worker
    assert code(scheduler.Register, worker, mine["gateway"]) == denied  # not a worker
    place = scheduler_pb2.PlaceRequest(request_id="x", prompt_tokens=3)
    assert code(scheduler.Place, place, mine["worker-0"]) == denied
    holders = scheduler_pb2.HoldersRequest(block_hashes=[1])  # the KV index: the owner's only
    assert code(scheduler.Holders, holders, mine["worker-0"]) == denied
    assert code(scheduler.Holders, holders, mine["gateway"]) == denied
    owner = os.environ[mesh_token.ENV]  # this process started the mesh
    assert owner.startswith("owner.") and code(scheduler.Holders, holders, owner) == ok
    assert code(scheduler.Register, worker, mine["worker-0"]) == grpc.StatusCode.OK  # itself
    forged = "gateway." + mine["worker-0"].partition(".")[2]
    assert code(scheduler.Place, place, forged) == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        _generate(worker.address, mine["worker-0"])
    assert err.value.code() == denied
    chunks = _generate(worker.address, mine["gateway"], max_tokens=2)  # the gateway's own
    assert chunks and chunks[-1].finish_reason
    with pytest.raises(grpc.RpcError) as err:  # nor over a link
        _link(worker.address, mine["worker-0"])
    assert err.value.code() == denied
    downs = _link(worker.address, mine["gateway"])
    assert downs[-1].ends[0].code == 0 and any(c.finish_reason for d in downs for c in d.chunks)
    assert [w.info.worker_id for w in list_workers(guarded_mesh)] == [worker.worker_id]
    assert list_workers(guarded_mesh)[0].info.address == worker.address


def test_insecure_internal_serves_strangers():
    spec = MeshSpec(model=str(ensure_default_model()), workers=1, port=0,
                    engine_argv=["--device", "cpu", "--max-model-len", "256"],
                    gateway_argv=["--max-model-len", "256"], insecure_internal=True,
                    kvstore=True)  # fmt: skip
    with Mesh(spec) as mesh:
        worker = list_workers(mesh)[0].info
        chunks = _generate(worker.address)
        assert "@" not in mesh.nats_url  # no login: NATS takes anyone too
        asyncio.run(_connect(mesh.nats_url))
        if mesh.redis_url:  # and Redis (where a redis-server exists)
            assert "@" not in mesh.redis_url
            assert redis.Redis.from_url(mesh.redis_url).ping()
        stats = kvstore_pb2_grpc.KvStoreStub(grpc.insecure_channel(mesh.kvstore_address))
        stats.Stats(kvstore_pb2.StatsRequest(), timeout=10)  # the store answers a stranger
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


def test_a_workers_nats_login_speaks_only_for_that_worker(guarded_mesh):
    own = guarded_mesh.service_nats_urls["worker-0"]
    assert own != guarded_mesh.nats_url and "worker-0:" in own
    assert guarded_mesh.child("worker-0").env["YINIAN_NATS_URL"] == own
    heard, errors = asyncio.run(_publish_as(
        guarded_mesh.nats_url, own,
        # another worker's subject; only the scheduler asks a worker to register
        refused=["yinian.load.worker-1", "yinian.register.worker-0"],
        allowed="yinian.load.worker-0"))  # fmt: skip
    assert "yinian.load.worker-1" not in heard and "yinian.register.worker-0" not in heard
    assert "yinian.load.worker-0" in heard  # its own subject: heard
    assert len([e for e in errors if "permissions violation" in e.lower()]) == 2, errors


def test_a_gateways_nats_login_reads_what_placing_needs_and_speaks_for_no_worker(guarded_mesh):
    own = guarded_mesh.service_nats_urls["gateway"]
    assert "gateway:" in own and guarded_mesh.child("gateway").env["YINIAN_NATS_URL"] == own
    heard, errors = asyncio.run(_publish_as(
        guarded_mesh.nats_url, own,
        refused=["yinian.load.worker-0", "yinian.kv.worker-0", "yinian.register.worker-0"],
        allowed="yinian.kvresync"))  # a gap in its KV index asks for a resync  # fmt: skip
    assert [s for s in heard if s != "yinian.kvresync"] == [] and "yinian.kvresync" in heard
    assert len([e for e in errors if "permissions violation" in e.lower()]) == 3, errors


def _probe(subject: str, data: bytes | None = None):
    """The probe's message on `subject`; with `data`: whether it is that message."""
    if subject == "yinian.kvresync":  # for a holder nobody is
        probe = common_pb2.KvResync(worker_id="nobody", reason="probe")
    else:  # a load no worker reports
        probe = common_pb2.LoadReport(worker_id=subject.rsplit(".", 1)[-1],
                                      num_requests_running=4242)  # fmt: skip
    if data is None:
        return probe
    heard = type(probe)()
    try:
        heard.ParseFromString(data)
    except Exception:  # the mesh's own message of another type
        return False
    return heard == probe


async def _publish_as(operator_url: str, url: str, refused: list[str], allowed: str):
    """Publishes on each subject with `url`'s login (the allowed one last): what the
    operator heard of them (the mesh's own messages on them left out), and the
    server's errors."""
    heard, errors = [], []

    async def on_message(msg) -> None:
        if msg.subject in (*refused, allowed) and _probe(msg.subject, msg.data):
            heard.append(msg.subject)

    async def on_error(exc) -> None:
        errors.append(str(exc))

    listener = await nats.connect(operator_url, connect_timeout=5)
    await listener.subscribe("yinian.>", cb=on_message)
    await listener.flush()
    speaker = await nats.connect(url, connect_timeout=5, error_cb=on_error)
    for subject in (*refused, allowed):
        await speaker.publish(subject, _probe(subject).SerializeToString())
    await speaker.flush()
    for _ in range(100):  # the server answers each refused publish with an error
        if len(errors) >= len(refused) and allowed in heard:
            break
        await asyncio.sleep(0.05)
    await speaker.close()
    await listener.close()
    return heard, errors


def test_a_message_speaking_for_another_service_than_its_subject_is_dropped(guarded_mesh):
    assert asyncio.run(_claims(guarded_mesh.nats_url)) == ["probe-a"]


async def _claims(url: str) -> list[str]:
    from services.common.bus import EventBus, load_subject

    got = []
    bus = EventBus(url, "probe")
    await bus.connect()
    await bus.subscribe(
        load_subject(),
        common_pb2.LoadReport,
        lambda m, _h: got.append(m.worker_id),
        lambda m: load_subject(m.worker_id),
    )  # as the scheduler does
    await bus.nc.flush()
    # on probe-a's subject, one report for probe-b, then one for probe-a: in order on one
    # connection, so once the second is in, the first was dropped, not late
    for worker_id in ("probe-b", "probe-a"):
        await bus.publish(load_subject("probe-a"), common_pb2.LoadReport(worker_id=worker_id))
    for _ in range(100):
        if "probe-a" in got:
            break
        await asyncio.sleep(0.05)
    await bus.close()
    return [w for w in got if w.startswith("probe")]  # the mesh's worker reports too


def test_the_stores_redis_warnings_never_show_its_password(caplog):
    from services.common.processes import free_port
    from services.kvstore.redis_guard import RedisGuard, TierUnavailable

    guard = RedisGuard(f"redis://kvstore:s3cret-pass@127.0.0.1:{free_port()}/0", timeout=0.2)

    async def ping():
        with pytest.raises(TierUnavailable):  # nothing listens there
            await guard.call("ping", guard.client.ping)
        await guard.client.aclose()

    asyncio.run(ping())
    warned = [r.getMessage() for r in caplog.records if "Redis at" in r.getMessage()]
    assert warned and "127.0.0.1" in warned[0]
    assert not any("s3cret" in line for line in warned)
