"""The mesh's one KV index, the scheduler's, as `Scheduler.Holders` shows it: it
follows a registered worker's KvEvents (GPU and host tiers) and the KV store's
SharedKvEvents, asks a worker for a resync after a gap and claims nothing of
it until the worker's reset batch comes."""

from __future__ import annotations

import time

import grpc
import pytest
from kvstore_helpers import FP, chain, payload
from kvstore_process import NatsRecorder
from redis_server import redis_server_binary

from proto.yinian.v1 import (
    common_pb2,
    kvstore_pb2,
    kvstore_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from services.common.bus import KV_RESYNC_SUBJECT, kv_subject
from services.common.kv_checksum import block_checksum
from services.common.tls import sync_channel
from yinian.mesh import Mesh, MeshSpec

pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="no redis-server")
WORKER = scheduler_pb2.WorkerInfo(
    worker_id="w1", address="127.0.0.1:9", role="colocated", model="tiny-llama",
    block_size=16, max_num_seqs=8, kv_blocks_total=100, host="127.0.0.1", device="cpu",
)  # fmt: skip


def holders(scheduler, hashes) -> list[tuple[list[str], list[str], bool]]:
    answer = scheduler.Holders(scheduler_pb2.HoldersRequest(block_hashes=hashes), timeout=5)
    return [(list(b.gpu), list(b.host), b.shared) for b in answer.blocks]


def wait_holders(scheduler, hashes, expected, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := holders(scheduler, hashes)) != expected:
        assert time.monotonic() < deadline, got
        time.sleep(0.05)


def test_the_index_follows_kv_events_and_asks_for_a_resync_after_a_gap(model_dir):
    spec = MeshSpec(model=str(model_dir("tiny-llama")), workers=0, gateways=0, port=0,
                    kvstore=True, scheduler_argv=["--heartbeat-timeout", "120"])  # fmt: skip
    with Mesh(spec) as mesh:
        scheduler = scheduler_pb2_grpc.SchedulerStub(sync_channel(mesh.scheduler_address, None))
        store = kvstore_pb2_grpc.KvStoreStub(sync_channel(mesh.kvstore_address, None))
        recorder = NatsRecorder(mesh.nats_url, {KV_RESYNC_SUBJECT: common_pb2.KvResync})
        try:
            scheduler.Register(WORKER, timeout=5)
            h1, h2, h3, h4 = chain(4, start=3)
            data = payload(h1)
            fingerprint = kvstore_pb2.ModelFingerprint(
                **{name: getattr(FP, name) for name in FP.__dataclass_fields__}
            )
            put = kvstore_pb2.PutBlock(fingerprint=fingerprint, block_hash=h1, data=data,
                                       checksum=block_checksum(data))  # fmt: skip
            assert store.Put(iter([put]), timeout=5).stored == 1
            events = common_pb2.KvEvents(
                worker_id="w1", event_id=1, reset=True, stored=[h1, h2], host_stored=[h3]
            )
            recorder.publish(kv_subject("w1"), events)
            everything = [(["w1"], [], True), (["w1"], [], False), ([], ["w1"], False)]
            wait_holders(scheduler, [h1, h2, h3, h4], everything)
            # a gap: the scheduler asks w1 to resync and claims nothing of it meanwhile
            recorder.publish(kv_subject("w1"), common_pb2.KvEvents(worker_id="w1", event_id=3))
            recorder.wait_for(KV_RESYNC_SUBJECT, lambda m: m.worker_id == "w1")
            wait_holders(scheduler, [h1, h2], [([], [], True)])
            events.event_id, events.stored[:] = 4, [h1, h2, h4]
            recorder.publish(kv_subject("w1"), events)  # the worker's answer: a reset batch
            wait_holders(scheduler, [h1, h2, h3, h4], everything + [(["w1"], [], False)])
            with pytest.raises(grpc.RpcError) as err:
                holders(scheduler, list(range(16_385)))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            recorder.close()
