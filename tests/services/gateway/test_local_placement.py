"""The gateway's own placer (services/gateway/local_placement.py): it follows the
scheduler's list of workers and settings, hears the KV events and load reports on
a real NATS, places by the scheduler's policy without a call, asks each worker it
lists anew for a KV snapshot, and leaves a request to the scheduler while it
cannot place it itself."""

from __future__ import annotations

import asyncio

import pytest

from basis.block_hash import hash_prompt_blocks
from proto.yinian.v1 import common_pb2, scheduler_pb2
from services.common.bus import KV_RESYNC_SUBJECT, EventBus
from services.common.errors import Saturated
from services.common.kv_index import GPU
from services.common.processes import start_nats, stop_process
from services.gateway.clients import SchedulerClient
from services.gateway.local_placement import LocalPlacement

PROMPT = list(range(1, 97))  # six blocks of 16
HASHES = hash_prompt_blocks(PROMPT, 16, "")


def status(worker_id: str, address: str, running: int = 0, max_num_seqs: int = 4):
    info = scheduler_pb2.WorkerInfo(worker_id=worker_id, address=address, role="colocated",
                                    block_size=16, max_num_seqs=max_num_seqs)  # fmt: skip
    return scheduler_pb2.WorkerStatus(info=info, ready=True, seconds_since_report=0.1,
                                      num_requests_running=running)  # fmt: skip


def listing(*workers, **settings) -> scheduler_pb2.ListWorkersResponse:
    placement = scheduler_pb2.PlacementSettings(
        request_tokens=64, memory_tokens=2048, host_hit_weight=0.1, shared_hit_weight=0.3,
        retry_after_seconds=2.5, disagg_min_tokens=512, heartbeat_timeout_seconds=3.0,
    )  # fmt: skip
    for key, value in settings.items():
        setattr(placement, key, value)
    return scheduler_pb2.ListWorkersResponse(workers=workers, placement=placement)


async def until(check, timeout: float = 20.0) -> bool:
    """Polls `check()` every 20 ms until it is true (True) or `timeout` passes (False)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


@pytest.fixture
def nats_url():
    proc, url = start_nats()
    yield url
    stop_process(proc)


def test_it_follows_the_schedulers_list_and_settings():
    asyncio.run(follows())


async def follows():
    # nothing here connects: apply() is the list's effect alone
    placer = LocalPlacement(SchedulerClient("127.0.0.1:9"), EventBus("nats://127.0.0.1:9", "t"))
    first = listing(status("w-a", "a:1"), status("w-b", "b:1"), max_waiting=3)
    assert placer.apply(first) == ["w-a", "w-b"]  # each is then asked for a KV snapshot
    assert placer.policy.max_waiting == 3 and placer.policy.retry_after == 2.5
    assert placer.registry.heartbeat_timeout == 3.0
    assert {w.worker_id for w in placer.registry.ready()} == {"w-a", "w-b"}
    assert placer.hash_block_size(8) == 16  # the workers' own: prompts hash as they cache
    placer.index.apply("w-a", 1, {GPU: (HASHES, [])}, reset=True)
    placer.index.apply("w-b", 1, {GPU: (HASHES, [])}, reset=True)
    assert placer.apply(first) == []  # nothing new
    assert placer.policy.max_waiting == 3

    # w-a registered again (at another address: a restart); w-b left out of the list
    again = listing(status("w-a", "a:2"))
    assert placer.apply(again) == ["w-a"]
    assert placer.policy.max_waiting is None  # unset: each worker's max_num_seqs
    assert placer.registry.workers["w-a"].address == "a:2"
    assert placer.index.sizes() == {("w-b", GPU): 6}  # w-a's old cache is not believed
    # w-b still reports: kept (a scheduler that just restarted lists nobody at first) ...
    assert set(placer.registry.workers) == {"w-a", "w-b"}
    # ... until its reports stop too
    placer.registry.workers["w-b"].last_seen -= 5.0
    placer.apply(again)
    assert list(placer.registry.workers) == ["w-a"] and placer.index.sizes() == {}
    # a scheduler older than this gateway sends no settings: it goes on placing
    assert placer.apply(scheduler_pb2.ListWorkersResponse(workers=[status("w-d", "d:1")])) == []
    assert placer.policy is None and not placer.ready
    odd = status("w-c", "c:1")
    odd.info.block_size = 32
    placer.apply(listing(status("w-a", "a:2"), odd))
    assert placer.hash_block_size(8) == 8  # no one size: the gateway's flag
    await placer.scheduler.close()


def test_it_places_by_the_kv_events_it_hears_without_a_call(nats_url, caplog):
    async def main():
        # a scheduler nobody serves: any call to it would fail
        placer = LocalPlacement(SchedulerClient("127.0.0.1:9", timeout=0.5),
                                EventBus(nats_url, "gateway"))  # fmt: skip
        listener = EventBus(nats_url, "listener")
        await listener.connect()
        asked = []
        await listener.subscribe(KV_RESYNC_SUBJECT, common_pb2.KvResync,
                                 lambda m, _h: asked.append(m.worker_id))  # fmt: skip
        await listener.nc.flush()  # subscribed at the server before anyone asks
        await placer.listen()
        # (workers stay ready for a minute here: a loaded CI host may be slow to deliver)
        both = listing(status("w-a", "a:1"), status("w-b", "b:1"), heartbeat_timeout_seconds=60.0)
        for worker_id in placer.apply(both):
            await placer._resync(worker_id)
        # w-b's snapshot, as it answers the resync: the prompt is in its GPU tier
        await listener.publish("yinian.kv.w-b", common_pb2.KvEvents(
            worker_id="w-b", event_id=1, reset=True, stored=HASHES))  # fmt: skip
        assert await until(lambda: placer.index.sizes() and len(asked) == 2)
        assert sorted(asked) == ["w-a", "w-b"]  # each listed anew asked for its snapshot
        placed = await placer.place("r1", len(PROMPT), HASHES, "", [], 16)
        assert (placed.worker_id, placed.address, placed.matched_blocks) == ("w-b", "b:1", 6)
        # a retry elsewhere after w-b failed
        other = await placer.place("r1", len(PROMPT), HASHES, "", ["w-b"], 16)
        assert (other.worker_id, other.matched_blocks) == ("w-a", 0)
        # every worker full (running max_num_seqs, queueing as many), as their load
        # reports say: 429, decided here
        for worker_id in ("w-a", "w-b"):
            await listener.publish(f"yinian.load.{worker_id}", common_pb2.LoadReport(
                worker_id=worker_id, num_requests_running=8))  # fmt: skip
        assert await until(lambda: all(w.running == 8 for w in placer.registry.workers.values()))
        with pytest.raises(Saturated) as saturated:
            await placer.place("r2", len(PROMPT), HASHES, "", [], 16)
        assert saturated.value.retry_after == 2.5
        # w-b has room again; w-a drains and says so in its load report: it leaves at once
        await listener.publish("yinian.load.w-b", common_pb2.LoadReport(worker_id="w-b"))
        await listener.publish("yinian.load.w-a", common_pb2.LoadReport(
            worker_id="w-a", draining=True))  # fmt: skip
        workers = placer.registry.workers
        assert await until(lambda: "w-a" not in workers and workers["w-b"].load == 0)
        assert list(placer.registry.workers) == ["w-b"]
        # a list the scheduler sent before it heard w-a drains does not bring it back
        placer.apply(both)
        assert list(placer.registry.workers) == ["w-b"]
        # NATS away (no heartbeat can arrive): the scheduler places; it is away too, so
        # the request goes where recent ones went (those placed here count)
        await placer.bus.close()
        fallback = await placer.place("r3", len(PROMPT), HASHES, "", [], 16)
        assert fallback.worker_id in ("w-a", "w-b") and fallback.matched_blocks == 0
        assert "scheduler unreachable" in caplog.text and "r3 placed as a recent" in caplog.text
        await listener.close()
        await placer.close()
        await placer.scheduler.close()

    asyncio.run(main())
