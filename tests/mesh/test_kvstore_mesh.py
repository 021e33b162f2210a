"""The KV store in the mesh, with real processes, a real Redis and NATS: a new
worker serves the next turn of a conversation from the shared tier (Redis, and
the store's memory tier in front of it, as `yinian up` starts it); damaged
blocks are caught and recomputed; a new worker on the store's host copies
the blocks the store lends straight to its device, and a damaged lent block is
caught there too when the worker reads lent checksums; Redis going away costs hits, never
requests; a lost KV event is repaired by a resync; tenants never read each
other's blocks. Every answer equals the engine's without any cache."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest
import redis
from kvstore_process import NatsRecorder
from prompts import random_prompts

from basis.block_hash import hash_prompt_blocks
from basis.urls import without_login
from engine import LLM, SamplingParams
from proto.yinian.v1 import (
    common_pb2,
    kvstore_pb2,
    kvstore_pb2_grpc,
)
from services.common.bus import KV_RESYNC_SUBJECT, kv_subject
from services.common.kv_checksum import block_checksum
from services.common.tls import aio_channel, sync_channel
from services.kvstore import block_format
from services.kvstore.fingerprint import Fingerprint
from services.worker.host import model_fingerprint
from yinian.mesh import Mesh, MeshSpec
from yinian.mesh_probe import gpu_holders, scheduler_metric, worker_metric

KEYS = {"A": "sk-tenant-a", "B": "sk-tenant-b"}
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def _spec(model_dir, keys, kvstore_argv) -> MeshSpec:
    return MeshSpec(
        model=str(model_dir("tiny-llama")),
        workers=1,
        port=0,  # the gateway binds any free port and names it
        gateway_argv=["--api-keys", str(keys)],
        engine_argv=["--device", "cpu", "--dtype", "float32"],
        worker_argv=["--kv-write-through", "all", "--load-interval", "0.2"],
        kvstore=True,
        kvstore_argv=kvstore_argv,
    )


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    return path


@pytest.fixture(scope="module")
def mesh(model_dir, keys):
    # Redis alone: these tests read and damage the blocks in Redis
    with Mesh(_spec(model_dir, keys, ["--memory-tier-bytes", "0"])) as m:
        yield m


@pytest.fixture(scope="module")
def memory_mesh(model_dir, keys):
    # the store as `yinian up` starts it: its memory tier in front of Redis
    with Mesh(_spec(model_dir, keys, [])) as m:
        yield m


@pytest.fixture(scope="module")
def reference(model_dir):
    return LLM(model_dir("tiny-llama"), device="cpu", dtype="float32", enable_prefix_caching=False)


def complete(mesh, prompt: list[int], tenant: str = "A") -> dict:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    resp = httpx.post(f"{mesh.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def expect(reference, prompt):
    out = reference.generate([prompt], GREEDY)[0].outputs[0]
    return out.text, list(out.token_ids)


def stub(mesh) -> kvstore_pb2_grpc.KvStoreStub:
    return kvstore_pb2_grpc.KvStoreStub(sync_channel(mesh.kvstore_address, None))


def stats(mesh, tenant: str | None = None) -> kvstore_pb2.StatsResponse:
    request = kvstore_pb2.StatsRequest(tenant=tenant) if tenant else kvstore_pb2.StatsRequest()
    return stub(mesh).Stats(request, timeout=5)


def wait_until(predicate, timeout: float = 20.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def stored_blocks(mesh, tenant: str) -> int:
    return sum(t.blocks for t in stats(mesh).tenants if t.tenant == tenant)


def fresh_worker(mesh) -> None:
    """kill -9 of the worker, and a new one in its place (empty device and host tiers)."""
    mesh.kill("worker-0")
    mesh.respawn("worker-0")
    wait_until(lambda: httpx.get(f"{mesh.url}/health", timeout=5).status_code == 200,
               what="the gateway to see the new worker")  # fmt: skip


def fetched_tokens(mesh) -> float:
    return sum(worker_metric(mesh, "yinian:kv_shared_fetched_tokens_total").values())


@pytest.mark.parametrize("store", ["redis", "memory tier"])
def test_next_turn_on_a_new_worker_is_served_from_the_shared_tier(request, store, reference):
    mesh = request.getfixturevalue("mesh" if store == "redis" else "memory_mesh")
    turn1 = random_prompts(500, (90,), seed=101)[0]
    text1, out1 = expect(reference, turn1)
    assert complete(mesh, turn1)["choices"][0]["text"] == text1
    wait_until(lambda: stored_blocks(mesh, "A") >= 6, what="the turn's blocks stored")
    fresh_worker(mesh)
    turn2 = turn1 + out1 + random_prompts(500, (20,), seed=102)[0]
    text2, _ = expect(reference, turn2)
    answer = complete(mesh, turn2)
    assert answer["choices"][0]["text"] == text2
    # prompt and answer of turn 1 (98 tokens): 6 whole blocks, all from the shared tier
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    assert fetched_tokens(mesh) >= 96


def test_a_new_worker_copies_lent_blocks_straight_to_its_device(memory_mesh, reference):
    turn1 = random_prompts(500, (110,), seed=103)[0]
    text1, out1 = expect(reference, turn1)
    before = stored_blocks(memory_mesh, "A")
    assert complete(memory_mesh, turn1)["choices"][0]["text"] == text1
    wait_until(lambda: stored_blocks(memory_mesh, "A") >= before + 7, what="the turn's blocks")
    fresh_worker(memory_mesh)
    wait_until(lambda: sum(worker_metric(memory_mesh, "yinian:kv_store_memory_mapped").values()),
               what="the new worker to map the store's memory")  # fmt: skip
    turn2 = turn1 + out1 + random_prompts(500, (9,), seed=104)[0]
    answer = complete(memory_mesh, turn2)
    assert answer["choices"][0]["text"] == expect(reference, turn2)[0]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 112
    # lent by the store's memory tier, copied into device blocks: none went to the host tier
    assert lent_tokens(memory_mesh, "lent") == 112 and lent_tokens(memory_mesh, "copied") == 0
    # the new worker's one prompt: checked against the shared tier, and blocks came
    prefetches = worker_metric(memory_mesh, "yinian:kv_shared_prefetches_total")
    assert sum(prefetches.values()) == 1
    assert sum(worker_metric(memory_mesh, "yinian:kv_shared_prefetches_total",
                             where='outcome="filled"').values()) == 1  # fmt: skip
    # and the engine counted them as device hits (its gauges follow its load reports)
    wait_until(lambda: sum(worker_metric(memory_mesh, "yinian:prefix_cache_hit_tokens",
                                         where='tier="gpu"').values()) >= 112,
               what="the worker to report the device hits")  # fmt: skip


def test_a_damaged_lent_block_is_caught_and_recomputed(memory_mesh, reference, model_dir):
    prompt = random_prompts(500, (70,), seed=105)[0]
    want, _ = expect(reference, prompt)
    before = stored_blocks(memory_mesh, "A")
    assert complete(memory_mesh, prompt)["choices"][0]["text"] == want
    wait_until(lambda: stored_blocks(memory_mesh, "A") >= before + 4, what="the prompt's blocks")
    facts = reference.engine.facts
    lent = stub(memory_mesh).Lend(kvstore_pb2.LendRequest(
        tenant="A", fingerprint=model_fingerprint(str(model_dir("tiny-llama")), reference.engine),
        block_bytes=facts.kv_block_bytes, block_hashes=hash_prompt_blocks(prompt, 16, "A"),
    ), timeout=5)  # fmt: skip
    assert len(lent.offsets) == 4
    with open(lent.region.path, "r+b") as region:  # a bit flipped in the store's memory
        region.seek(lent.offsets[0] + 100)
        byte = region.read(1)[0]
        region.seek(lent.offsets[0] + 100)
        region.write(bytes([byte ^ 0x10]))
    worker = memory_mesh.child("worker-0")  # lent blocks' checksums are read when asked
    worker.command = [*worker.command, "--kv-verify-lent-blocks"]
    fresh_worker(memory_mesh)
    answer = complete(memory_mesh, prompt)
    assert answer["choices"][0]["text"] == want
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the chain broke at 0
    assert sum(worker_metric(memory_mesh, "yinian:kv_shared_rejected_blocks_total").values()) == 1


def test_a_worker_told_not_to_lend_takes_the_stores_blocks_through_its_host_tier(
    memory_mesh, reference
):
    """--no-kv-lend: the worker never maps the store's memory (nothing pinned for it),
    and the shared tier still serves it, by copies into its host tier."""
    prompt = random_prompts(500, (75,), seed=106)[0]
    want, _ = expect(reference, prompt)
    before = stored_blocks(memory_mesh, "A")
    assert complete(memory_mesh, prompt)["choices"][0]["text"] == want
    wait_until(lambda: stored_blocks(memory_mesh, "A") >= before + 4, what="the prompt's blocks")
    worker = memory_mesh.child("worker-0")
    command = worker.command
    worker.command = [*command, "--no-kv-lend"]
    try:
        fresh_worker(memory_mesh)
        answer = complete(memory_mesh, prompt)
        assert answer["choices"][0]["text"] == want
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        assert lent_tokens(memory_mesh, "copied") == 64 and lent_tokens(memory_mesh, "lent") == 0
        assert sum(worker_metric(memory_mesh, "yinian:kv_store_memory_mapped").values()) == 0
    finally:
        worker.command = command


def lent_tokens(mesh, path: str) -> float:
    where = f'path="{path}"'
    return sum(worker_metric(mesh, "yinian:kv_shared_fetched_tokens_total", where=where).values())


def _payload_length(value: bytes) -> int:
    return block_format._FIXED.unpack_from(value)[4]


def _forged(value: bytes, fp: dict) -> bytes:
    """The block rewritten as someone with Redis but without the mesh's key would:
    another payload, every checksum recomputed."""
    payload = b"!" * _payload_length(value)
    return block_format.encode(
        Fingerprint(**fp).canonical(), "A", *block_format._FIXED.unpack_from(value)[2:4],
        block_checksum(payload), payload, key=bytes(32),
    )  # fmt: skip


def _payload(value: bytes) -> bytes:
    end = len(value) - block_format.TAG_BYTES
    return value[end - _payload_length(value) : end]


DAMAGE = {
    "flipped byte": lambda value, fp: value[:-25] + bytes([value[-25] ^ 0x40]) + value[-24:],
    "truncated": lambda value, fp: value[: len(value) // 2],
    "other model": lambda value, fp: block_format.encode(
        Fingerprint(**{**fp, "model_id": "another-model"}).canonical(),
        "A",
        *block_format._FIXED.unpack_from(value)[2:4],
        block_format._FIXED.unpack_from(value)[5],
        _payload(value),
        key=bytes(32),
    ),
    "forged": _forged,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_blocks_are_caught_and_recomputed(mesh, reference, damage):
    prompt = random_prompts(500, (70,), seed=110 + list(DAMAGE).index(damage))[0]
    want, _ = expect(reference, prompt)
    assert complete(mesh, prompt)["choices"][0]["text"] == want
    first = hash_prompt_blocks(prompt, 16, "A")[0]
    client = redis.Redis.from_url(mesh.redis_url)
    key = wait_until(lambda: next(iter(client.scan_iter(f"*{{t:A}}:b:*:{first:016x}")), None),
                     what="the first block in Redis")  # fmt: skip
    fp_id = key.decode().split(":b:")[1].split(":")[0]
    fp = Fingerprint.from_canonical(client.hget("yinian:kv:fingerprints", fp_id))
    client.set(key, DAMAGE[damage](client.get(key), _fields(fp)))
    before = stats(mesh, "A").tenants[0].verification_failures
    fresh_worker(mesh)
    answer = complete(mesh, prompt)
    assert answer["choices"][0]["text"] == want
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the chain broke at 0
    assert stats(mesh, "A").tenants[0].verification_failures == before + 1


def _fields(fp: Fingerprint) -> dict:
    return {name: getattr(fp, name) for name in fp.__dataclass_fields__}


def test_the_stores_redis_login_reaches_its_own_keys_only(mesh):
    owner = redis.Redis.from_url(mesh.redis_url)  # the mesh owner's login: every key
    owner.set("yinian:ratelimit:{t}:probe", b"1")
    store = redis.Redis.from_url(mesh.kvstore_redis_url)
    assert store.set("yinian:kv:probe", b"1") and store.get("yinian:kv:probe") == b"1"
    for call in (lambda: store.get("yinian:ratelimit:{t}:probe"), store.flushall,
                 lambda: store.config_get("maxmemory"), lambda: store.keys("*")):  # fmt: skip
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()
    with pytest.raises(redis.exceptions.AuthenticationError):  # no anonymous user
        redis.Redis.from_url(without_login(mesh.redis_url)).ping()
    assert owner.get("yinian:ratelimit:{t}:probe") == b"1"
    owner.delete("yinian:ratelimit:{t}:probe", "yinian:kv:probe")


def test_the_store_answers_no_stranger(mesh):
    # a caller without the mesh's token: no tenants' stats, no tenant's blocks
    stranger = kvstore_pb2_grpc.KvStoreStub(grpc.insecure_channel(mesh.kvstore_address))
    for call, request in [
        (stranger.Stats, kvstore_pb2.StatsRequest()),
        (stranger.Get, kvstore_pb2.GetRequest(
            tenant="A", fingerprint=kvstore_pb2.ModelFingerprint(model_id="any"),
            block_hashes=[1, 2])),
    ]:  # fmt: skip
        with pytest.raises(grpc.RpcError) as err:
            answer = call(request, timeout=10)
            if call is stranger.Get:
                list(answer)  # a stream: its status comes with the first read
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    stats(mesh)  # the mesh's own call is answered (it raises otherwise)


def test_the_mesh_redis_refuses_a_client_without_its_password(mesh):
    bare = "redis://" + mesh.redis_url.rsplit("@", 1)[-1]
    assert bare != mesh.redis_url  # the mesh's own URL carries its password
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(bare).keys("*")
    assert redis.Redis.from_url(mesh.redis_url).ping()


def test_redis_down_costs_hits_not_requests(mesh, reference):
    mesh.kill_redis()
    prompts = random_prompts(500, (40, 55, 70), seed=120)
    for prompt in prompts + prompts:
        assert complete(mesh, prompt)["choices"][0]["text"] == expect(reference, prompt)[0]
    mesh.restart_redis()
    wait_until(lambda: stats(mesh).redis_up, what="the KV store to see Redis again")
    prompt = random_prompts(500, (80,), seed=121)[0]
    want, _ = expect(reference, prompt)
    assert complete(mesh, prompt)["choices"][0]["text"] == want
    wait_until(lambda: stored_blocks(mesh, "A") >= 4, what="writes to reach the new Redis")
    fresh_worker(mesh)
    answer = complete(mesh, prompt)
    assert answer["choices"][0]["text"] == want
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 64  # from Redis


def test_a_lost_kv_event_is_repaired_by_resync(mesh, reference):
    prompt = random_prompts(500, (60,), seed=130)[0]
    hashes = hash_prompt_blocks(prompt, 16, "A")
    bogus = random_prompts(500, (64,), seed=131)[0]  # never computed by anyone
    bogus_hashes = hash_prompt_blocks(bogus, 16, "A")
    recorder = NatsRecorder(mesh.nats_url, {kv_subject("worker-0"): common_pb2.KvEvents,
                                            KV_RESYNC_SUBJECT: common_pb2.KvResync})  # fmt: skip
    try:
        complete(mesh, prompt)
        wait_until(lambda: recorder.received[kv_subject("worker-0")], what="the worker's events")
        time.sleep(0.3)  # the request's last batches
        last = max(e.event_id for e in recorder.received[kv_subject("worker-0")])
        # A stale entry, as if the batch that removed these blocks had been lost: the
        # index believes the worker holds the bogus prompt.
        recorder.publish(kv_subject("worker-0"), common_pb2.KvEvents(
            worker_id="worker-0", event_id=last + 1, stored=bogus_hashes))  # fmt: skip
        time.sleep(0.3)
        answer = complete(mesh, bogus)  # placed on a stale entry: the worker computes it
        assert answer["choices"][0]["text"] == expect(reference, bogus)[0]
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # and a gap: the index asks the worker to resync, the worker sends a snapshot
        recorder.publish(kv_subject("worker-0"), common_pb2.KvEvents(
            worker_id="worker-0", event_id=last + 50, stored=[12345]))  # fmt: skip
        recorder.wait_for(KV_RESYNC_SUBJECT, lambda r: r.worker_id == "worker-0")
        recorder.wait_for(kv_subject("worker-0"), lambda e: e.reset and e.event_id > 1)
        # the scheduler counts the gap it saw, by holder
        gaps = 'holder="worker-0"'
        wait_until(lambda: scheduler_metric(mesh, "yinian:kv_index_gaps_total", gaps) >= 1,
                   what="the scheduler to count the gap")  # fmt: skip
    finally:
        recorder.close()

    repaired = wait_until(  # the mesh's one KV index: the scheduler's
        lambda: (h := gpu_holders(mesh, hashes)) and all("worker-0" in x for x in h) and h,
        what="the index to hold the worker's real blocks",
    )
    assert len(repaired) == len(hashes)
    assert gpu_holders(mesh, [12345]) == []  # the injected entry is gone


def _fingerprint(mesh) -> kvstore_pb2.ModelFingerprint:
    client = redis.Redis.from_url(mesh.redis_url)
    fp = Fingerprint.from_canonical(next(iter(client.hvals("yinian:kv:fingerprints"))))
    return kvstore_pb2.ModelFingerprint(**_fields(fp))


def test_tenants_never_read_each_others_blocks(mesh, reference):
    prompt = random_prompts(500, (75,), seed=140)[0]
    want, _ = expect(reference, prompt)
    complete(mesh, prompt, "A")
    wait_until(lambda: stored_blocks(mesh, "A") > 0, what="A's blocks")
    answer = complete(mesh, prompt, "B")  # the same prompt: nothing of A's is used
    assert answer["choices"][0]["text"] == want
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    a_hashes = hash_prompt_blocks(prompt, 16, "A")  # A's exact hashes, asked for as B

    async def get_as(tenant):
        async with aio_channel(mesh.kvstore_address, None) as channel:
            request = kvstore_pb2.GetRequest(
                tenant=tenant, fingerprint=_fingerprint(mesh), block_hashes=a_hashes
            )
            return [b async for b in kvstore_pb2_grpc.KvStoreStub(channel).Get(request)]

    assert len(asyncio.run(get_as("A"))) == len(a_hashes)
    assert asyncio.run(get_as("B")) == []
