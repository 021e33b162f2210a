"""`python -m services.kvstore` as the workers and the scheduler meet it: real
Redis, real NATS, gRPC. Tenants never see each other's blocks, bad requests are
INVALID_ARGUMENT and change nothing, Lookup answers for the shared tier alone
(the scheduler's index says which workers hold blocks: tests/services/scheduler/
test_kv_index.py), and the shared tier's changes go out as numbered
SharedKvEvents starting with a snapshot."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import grpc
import pytest
from kvstore_helpers import FP, chain, harness, payload, run
from kvstore_process import KvStoreProcess, NatsRecorder
from redis_server import RedisServer, redis_server_binary

from proto.yinian.v1 import common_pb2, kvstore_pb2, kvstore_pb2_grpc
from services.common.bus import KV_RESYNC_SUBJECT, SHARED_KV_SUBJECT, kv_subject
from services.common.kv_checksum import block_checksum
from services.common.processes import start_nats, stop_process
from services.common.tls import sync_channel

pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="no redis-server")
WIRE_FP = kvstore_pb2.ModelFingerprint(
    model_id=FP.model_id, dtype=FP.dtype, block_size=FP.block_size, layout=FP.layout,
    num_layers=FP.num_layers, format_version=FP.format_version,
)  # fmt: skip
SEED_TENANT, (SEED_HASH,) = "seed", chain(1, start=99)


@pytest.fixture(scope="module")
def mesh():
    nats_proc, nats_url = start_nats()
    redis = RedisServer().start()
    subjects = {
        KV_RESYNC_SUBJECT: common_pb2.KvResync,
        SHARED_KV_SUBJECT: common_pb2.SharedKvEvents,
    }
    recorder = NatsRecorder(nats_url, subjects)
    run(_seed(redis.url))  # in Redis before the store starts: its first snapshot lists it
    store = KvStoreProcess(nats_url, redis.url, "--max-block-bytes", "65536").wait_ready()
    channel = sync_channel(store.address, None)
    try:
        yield store, kvstore_pb2_grpc.KvStoreStub(channel), recorder, nats_url
    finally:
        channel.close()
        store.stop()
        recorder.close()
        redis.stop()
        stop_process(nats_proc)


async def _seed(url: str) -> None:
    h = harness(url)
    await h.put(SEED_TENANT, SEED_HASH)
    await h.close()


def block(tenant: str, h: int, data: bytes | None = None, **fields) -> kvstore_pb2.PutBlock:
    data = payload(h) if data is None else data
    message = kvstore_pb2.PutBlock(
        tenant=tenant, fingerprint=WIRE_FP, block_hash=h, data=data, checksum=block_checksum(data)
    )
    for name, value in fields.items():
        setattr(message, name, value) if name != "fingerprint" else message.ClearField(name)
    return message


def lookup(stub, tenant: str, hashes) -> kvstore_pb2.LookupResponse:
    return stub.Lookup(
        kvstore_pb2.LookupRequest(tenant=tenant, fingerprint=WIRE_FP, block_hashes=hashes)
    )


def get(stub, tenant: str, hashes) -> list[kvstore_pb2.StoredBlock]:
    request = kvstore_pb2.GetRequest(tenant=tenant, fingerprint=WIRE_FP, block_hashes=hashes)
    return list(stub.Get(request))


def holders(response) -> list[list[tuple[str, int]]]:
    return [[(h.holder, h.tier) for h in loc.holders] for loc in response.locations]


def test_help_runs():
    out = subprocess.run(
        [sys.executable, "-m", "services.kvstore", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "--tenant-quota-bytes" in out.stdout


def test_start_snapshots_redis(mesh):
    _, _, recorder, _ = mesh
    first = recorder.wait_for(SHARED_KV_SUBJECT, lambda m: m.event_id == 1)
    assert first.reset and list(first.stored) == [SEED_HASH]


def test_tenants_never_see_each_others_blocks(mesh):
    _, stub, _, _ = mesh
    secret, public = chain(2, start=1)
    response = stub.Put(iter([block("alpha", secret), block("__public__", public)]))
    assert (response.stored, response.rejected) == (2, 0)
    assert stub.Put(iter([block("alpha", secret)])).already_present == 1
    shared = ("shared", kvstore_pb2.KV_TIER_SHARED)
    assert holders(lookup(stub, "alpha", [secret])) == [[shared]]
    # beta asks for alpha's exact hash: nothing, by Lookup or by Get.
    assert lookup(stub, "beta", [secret]).locations == []
    assert get(stub, "beta", [secret]) == []
    assert [b.data for b in get(stub, "alpha", [secret])] == [payload(secret)]
    # The public namespace is everyone's.
    assert lookup(stub, "beta", [public]).shared_prefix_blocks == 1
    assert [b.block_hash for b in get(stub, "beta", [public])] == [public]


def test_bad_requests_are_invalid_argument_and_change_nothing(mesh):
    _, stub, _, _ = mesh
    (h,) = chain(1, start=2)
    no_fp = kvstore_pb2.LookupRequest(tenant="bad", block_hashes=[h])
    bad_fp = kvstore_pb2.ModelFingerprint(model_id="m", dtype="f", layout="l", num_layers=1)
    calls = [
        lambda: stub.Lookup(no_fp),
        lambda: lookup(stub, "bad", list(range(16_385))),
        lambda: get(stub, "bad", list(range(16_385))),
        lambda: list(stub.Get(kvstore_pb2.GetRequest(tenant="bad", fingerprint=bad_fp))),
        lambda: stub.Put(iter([block("bad", h, fingerprint=None)])),
        lambda: stub.Put(iter([block("bad", h, data=b"x" * 70_000)])),
        lambda: stub.Put(iter([block("bad", h, data=b"")])),
        lambda: stub.Put(iter([block("b" * 300, h)])),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    corrupted = block("bad", h)
    corrupted.checksum ^= 1
    response = stub.Put(iter([corrupted]))
    assert response.rejected == 1 and "checksum" in response.reasons[0]
    assert list(response.rejected_hashes) == [h]
    (stats,) = stub.Stats(kvstore_pb2.StatsRequest(tenant="bad")).tenants
    assert (stats.blocks, stats.stored_blocks, stats.rejected_puts) == (0, 0, 1)
    assert lookup(stub, "bad", [h]).locations == []


def test_lookup_answers_for_the_shared_tier_alone(mesh):
    """Worker KV events change nothing the store says: which worker holds a block
    is the scheduler's index."""
    _, stub, recorder, _ = mesh
    h1, h2, h3 = chain(3, start=3)
    stub.Put(iter([block("", h1), block("", h3)]))
    events = common_pb2.KvEvents(worker_id="w1", event_id=1, reset=True, stored=[h1, h2, h3])
    recorder.publish(kv_subject("w1"), events)
    shared = ("shared", kvstore_pb2.KV_TIER_SHARED)
    answer = lookup(stub, "", [h1, h2, h3])
    assert holders(answer) == [[shared]] and answer.shared_prefix_blocks == 1


def test_shared_tier_changes_are_published_in_order(mesh):
    _, stub, recorder, _ = mesh
    (h,) = chain(1, start=4)
    stub.Put(iter([block("gamma", h)]))
    recorder.wait_for(SHARED_KV_SUBJECT, lambda m: h in m.stored and not m.reset)
    recorder.publish(KV_RESYNC_SUBJECT, common_pb2.KvResync(worker_id="shared"))
    snapshot = recorder.wait_for(SHARED_KV_SUBJECT, lambda m: m.reset and m.event_id > 1)
    assert {h, SEED_HASH} <= set(snapshot.stored)
    ids = [m.event_id for m in recorder.received[SHARED_KV_SUBJECT]]
    assert ids == list(range(1, len(ids) + 1)), "numbered without gaps"


def test_stats_and_metrics(mesh):
    store, stub, _, _ = mesh
    hashes = chain(3, start=5)
    stub.Put(iter([block("delta", x) for x in hashes[:2]]))
    assert lookup(stub, "delta", hashes).shared_prefix_blocks == 2
    assert len(get(stub, "delta", hashes)) == 2
    stats = stub.Stats(kvstore_pb2.StatsRequest(tenant="delta"))
    (t,) = stats.tenants
    assert (t.blocks, t.stored_blocks, t.hit_blocks, t.miss_blocks) == (2, 2, 2, 1)
    assert (t.hit_tokens, t.get_blocks, t.get_misses) == (32, 2, 1)
    assert t.bytes > 2 * len(payload(0)) and t.quota_bytes == 1 << 30
    assert stats.shared_tier_enabled and stats.redis_up and stats.redis_latency_mean_ms > 0
    everyone = {t.tenant for t in stub.Stats(kvstore_pb2.StatsRequest()).tenants}
    assert {"delta", SEED_TENANT} <= everyone
    url = f"http://127.0.0.1:{store.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    assert 'yinian:kvstore_lookup_blocks_total{result="hit",tenant="delta"} 2.0' in text
    assert "yinian:kvstore_redis_seconds_bucket" in text


def test_without_redis_it_stores_nothing_and_says_so(mesh):
    _, _, recorder, nats_url = mesh
    store = KvStoreProcess(nats_url).wait_ready()
    try:
        assert store.log.count("shared tier is off") == 1
        with sync_channel(store.address, None) as channel:
            stub = kvstore_pb2_grpc.KvStoreStub(channel)
            (h,) = chain(1, start=6)
            response = stub.Put(iter([block("", h)]))
            assert response.rejected == 1 and "no shared tier" in response.reasons[0]
            answer = lookup(stub, "", [h])
            assert answer.locations == [] and answer.shared_prefix_blocks == 0
    finally:
        store.stop()
