"""The KV store's same-host data plane, against `python -m services.kvstore`
with a real Redis: PutFrom stores blocks it reads out of a worker's host tier
(a shared-memory file) and GetInto writes them into another, byte for byte;
with Redis alone and with the store's memory tier in front of it; a request
naming memory outside the region, or a file that is no host tier,
is INVALID_ARGUMENT and stores nothing; a region the store cannot open is
FAILED_PRECONDITION (the worker then sends bytes)."""

from __future__ import annotations

import os
import time

import grpc
import pytest
import torch
from kvstore_helpers import FP, chain
from kvstore_process import KvStoreProcess
from redis_server import RedisServer, redis_server_binary

from engine.host_memory import allocate
from proto.yinian.v1 import kvstore_pb2, kvstore_pb2_grpc
from services.common.kv_checksum import block_checksum
from services.common.processes import start_nats, stop_process
from services.common.tls import sync_channel

pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="no redis-server")
WIRE_FP = kvstore_pb2.ModelFingerprint(
    model_id=FP.model_id, dtype=FP.dtype, block_size=FP.block_size, layout=FP.layout,
    num_layers=FP.num_layers, format_version=FP.format_version,
)  # fmt: skip
BLOCK = 8192
SLOTS = 6


# Redis alone, and the store's memory tier in front of it
@pytest.fixture(scope="module", params=[(), ("--memory-tier-bytes", str(64 * BLOCK))],
                ids=["redis", "memory"])  # fmt: skip
def stub(request):
    nats_proc, nats_url = start_nats()
    redis = RedisServer().start()
    store = KvStoreProcess(nats_url, redis.url, *request.param).wait_ready()
    channel = sync_channel(store.address, None)
    try:
        yield kvstore_pb2_grpc.KvStoreStub(channel)
    finally:
        channel.close()
        store.stop()
        redis.stop()
        stop_process(nats_proc)


def region():
    memory = allocate((SLOTS, BLOCK), torch.uint8, cuda=False)
    assert memory.path is not None and memory.path.name.startswith("yinian-kv-")
    return memory


def wire(memory) -> kvstore_pb2.SharedRegion:
    return kvstore_pb2.SharedRegion(path=str(memory.path), size=memory.size)


def put_from(stub, memory, tenant, hashes, slots, **fields):
    blocks = [kvstore_pb2.RegionBlock(block_hash=h, parent_hash=p, offset=s * BLOCK)
              for h, p, s in zip(hashes, [0, *hashes], slots)]  # fmt: skip
    request = kvstore_pb2.PutFromRequest(tenant=tenant, fingerprint=WIRE_FP, region=wire(memory),
                                         block_bytes=BLOCK, blocks=blocks, **fields)  # fmt: skip
    return stub.PutFrom(request, timeout=10)


def get_into(stub, memory, tenant, hashes, slots):
    request = kvstore_pb2.GetIntoRequest(
        tenant=tenant, fingerprint=WIRE_FP, region=wire(memory), block_bytes=BLOCK,
        block_hashes=hashes, offsets=[s * BLOCK for s in slots],
    )  # fmt: skip
    return stub.GetInto(request, timeout=10)


def test_blocks_go_from_one_host_tier_to_another_through_redis(stub):
    a, b = region(), region()
    a.tensor.random_(0, 256)
    b.tensor.fill_(7)
    hashes = chain(3, start=501)
    answer = put_from(stub, a, "t1", hashes, [4, 0, 2])
    assert answer.stored == 3 and answer.rejected == 0
    got = get_into(stub, b, "t1", hashes, [1, 3, 5])
    assert list(got.parent_hashes) == [0, *hashes[:2]]
    for src, dst, checksum in zip([4, 0, 2], [1, 3, 5], got.checksums):
        assert torch.equal(b.tensor[dst], a.tensor[src])
        assert block_checksum(b.tensor[dst].numpy()) == checksum
    assert torch.all(b.tensor[0] == 7) and torch.all(b.tensor[2] == 7)  # nothing else written
    assert list(get_into(stub, b, "t2", hashes, [0, 1, 2]).checksums) == []  # another tenant
    a.close()
    b.close()


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_bad_regions_are_refused_before_anything_is_stored(stub, tmp_path):
    a = region()
    a.tensor.random_(0, 256)
    hashes = chain(2, start=601)
    request = kvstore_pb2.PutFromRequest(
        tenant="t1", fingerprint=WIRE_FP, region=wire(a), block_bytes=BLOCK,
        blocks=[kvstore_pb2.RegionBlock(block_hash=hashes[0], offset=0),
                kvstore_pb2.RegionBlock(block_hash=hashes[1], offset=SLOTS * BLOCK - 10)],
    )  # fmt: skip
    assert _code(lambda: stub.PutFrom(request, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
    lookup = kvstore_pb2.LookupRequest(tenant="t1", fingerprint=WIRE_FP, block_hashes=hashes)
    assert stub.Lookup(lookup, timeout=10).shared_prefix_blocks == 0  # the first was not stored
    other = tmp_path / "yinian-kv-elsewhere"
    other.write_bytes(b"\0" * BLOCK)
    outside = kvstore_pb2.GetIntoRequest(
        tenant="t1", fingerprint=WIRE_FP, block_bytes=BLOCK, block_hashes=hashes[:1], offsets=[0],
        region=kvstore_pb2.SharedRegion(path=str(other), size=BLOCK),
    )  # fmt: skip
    assert _code(lambda: stub.GetInto(outside, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
    mismatch = kvstore_pb2.GetIntoRequest(
        tenant="t1", fingerprint=WIRE_FP, region=wire(a), block_bytes=BLOCK,
        block_hashes=hashes, offsets=[0],
    )  # fmt: skip
    assert _code(lambda: stub.GetInto(mismatch, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
    gone = wire(a)
    gone.path = os.path.join(os.path.dirname(gone.path), "yinian-kv-1-notthere")
    missing = kvstore_pb2.PutFromRequest(
        tenant="t1", fingerprint=WIRE_FP, region=gone, block_bytes=BLOCK,
        blocks=[kvstore_pb2.RegionBlock(block_hash=hashes[0], offset=0)],
    )  # fmt: skip
    assert _code(lambda: stub.PutFrom(missing, timeout=10)) == grpc.StatusCode.FAILED_PRECONDITION
    bigger = kvstore_pb2.SharedRegion(path=str(a.path), size=a.size + BLOCK)
    request = kvstore_pb2.PutFromRequest(
        tenant="t1", fingerprint=WIRE_FP, region=bigger, block_bytes=BLOCK,
        blocks=[kvstore_pb2.RegionBlock(block_hash=hashes[0], offset=0)],
    )  # fmt: skip
    assert _code(lambda: stub.PutFrom(request, timeout=10)) == grpc.StatusCode.FAILED_PRECONDITION
    assert stub.Lookup(lookup, timeout=10).shared_prefix_blocks == 0
    a.close()


def test_a_removed_region_is_unmapped_when_the_next_one_is_mapped(tmp_path):
    """A worker's file, once removed (it stopped, or a new worker replaced it), is not
    kept alive by the store's mapping of it."""
    from services.kvstore.regions import Regions

    regions = Regions(tmp_path)
    first, second = tmp_path / "yinian-kv-1-a", tmp_path / "yinian-kv-2-b"
    for path in (first, second):
        path.write_bytes(b"\1" * BLOCK)
    assert bytes(regions.view(str(first), BLOCK, 0, 4)) == b"\1" * 4
    assert str(first) in _mapped()
    first.unlink()
    regions.view(str(second), BLOCK, 0, 4)
    assert str(second) in _mapped()
    # unmapped in the background (freeing a removed worker's GiBs takes seconds)
    deadline = time.monotonic() + 5
    while str(first) in _mapped() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert str(first) not in _mapped()
    regions.close()


def _mapped() -> str:
    with open("/proc/self/maps") as f:
        return f.read()


def test_the_store_leaves_a_region_alone_near_the_callers_deadline(stub):
    """The caller may reuse its slots once its deadline passes: a call whose deadline
    is already within the store's margin touches nothing."""
    a, b = region(), region()
    a.tensor.random_(0, 256)
    b.tensor.fill_(3)
    hashes = chain(2, start=701)
    blocks = [kvstore_pb2.RegionBlock(block_hash=h, offset=i * BLOCK) for i, h in enumerate(hashes)]
    late = kvstore_pb2.PutFromRequest(tenant="t3", fingerprint=WIRE_FP, region=wire(a),
                                      block_bytes=BLOCK, blocks=blocks)  # fmt: skip
    assert stub.PutFrom(late, timeout=0.8).stored == 0
    assert put_from(stub, a, "t3", hashes, [0, 1]).stored == 2
    request = kvstore_pb2.GetIntoRequest(
        tenant="t3", fingerprint=WIRE_FP, region=wire(b), block_bytes=BLOCK,
        block_hashes=hashes, offsets=[0, BLOCK],
    )  # fmt: skip
    assert list(stub.GetInto(request, timeout=0.8).checksums) == []
    assert torch.all(b.tensor == 3)
    assert len(stub.GetInto(request, timeout=10).checksums) == 2
    a.close()
    b.close()
