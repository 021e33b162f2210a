"""The KV index (per holder and tier, from numbered events) and placement by
cost: tokens to compute, cheaper when cached in a tier, plus load."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from services.common import metrics
from services.common.errors import Saturated, WorkerUnavailable
from services.common.kv_index import GPU, HOST, SHARED, SHARED_HOLDER, KvIndex
from services.common.placement import PlacementPolicy, place
from services.common.registry import Registry, WorkerState
from services.scheduler.app import export_index
from yinian.mesh_probe import sample_sum

H = list(range(100, 110))  # a prompt's 10 block hashes


def test_index_applies_numbered_batches_and_detects_gaps():
    index = KvIndex()
    assert index.apply("w1", 1, {GPU: (H[:4], [])}, reset=True)
    assert index.apply("w1", 2, {HOST: (H[4:6], []), GPU: ([], [H[3]])})
    assert index.prefix_by_tier("w1", H) == [GPU, GPU, GPU]  # block 3 left the GPU tier
    assert index.matched_blocks("w1", H, tiers=(GPU, HOST)) == 3
    assert not index.apply("w1", 4, {GPU: ([H[3]], [])})  # batch 3 was lost
    assert index.needs_resync == {"w1"} and index.gaps == 1
    assert index.prefix_by_tier("w1", H) == []  # forgets rather than guess
    assert not index.apply("w1", 5, {GPU: ([H[0]], [])})  # still out of sync
    assert index.prefix_by_tier("w1", H) == []
    assert index.apply("w1", 6, {GPU: (H[:2], []), HOST: (H[2:5], [])}, reset=True)
    assert index.needs_resync == set()
    assert index.prefix_by_tier("w1", H) == [GPU, GPU, HOST, HOST, HOST]


def test_the_index_size_is_exported_and_a_forgotten_worker_leaves_the_metric():
    index, shown = KvIndex(), set()
    index.apply("w1", 1, {GPU: (H[:4], []), HOST: (H[4:6], [])}, reset=True)
    index.apply("w2", 1, {GPU: (H[:1], [])}, reset=True)
    shown = export_index(index, shown)
    text = generate_latest(metrics.SCHEDULER).decode()
    assert sample_sum(text, "yinian:kv_index_blocks", 'holder="w1",tier="gpu"') == 4
    assert sample_sum(text, "yinian:kv_index_blocks", 'holder="w1",tier="host"') == 2
    assert sample_sum(text, "yinian:kv_index_blocks", 'holder="w2"') == 1
    index.forget("w1")
    export_index(index, shown)
    text = generate_latest(metrics.SCHEDULER).decode()
    assert 'holder="w1"' not in text
    assert sample_sum(text, "yinian:kv_index_blocks", 'holder="w2"') == 1


def test_index_prefix_continues_in_the_shared_tier():
    index = KvIndex()
    index.apply("w1", 1, {GPU: (H[:2], [])}, reset=True)
    index.apply(SHARED_HOLDER, 1, {SHARED: (H[:6], [])}, reset=True)
    assert index.prefix_by_tier("w1", H) == [GPU, GPU] + [SHARED] * 4
    assert index.prefix_by_tier("w2", H) == [SHARED] * 6
    index.forget("w1")
    assert index.holders(H[0]) == {(SHARED_HOLDER, SHARED)}


def worker(registry: Registry, wid: str, running: int = 0) -> WorkerState:
    state = WorkerState(wid, f"{wid}:1", "colocated", block_size=16, max_num_seqs=8)
    registry.register(state)
    registry.on_load(wid, running, 0, 0.0)
    return state


def test_placement_prefers_the_cheapest_tier_then_the_least_loaded():
    registry, index, policy = Registry(), KvIndex(), PlacementPolicy()
    for wid in ("a", "b", "c"):
        worker(registry, wid)
    index.apply("a", 1, {HOST: (H, [])}, reset=True)
    index.apply("b", 1, {GPU: (H, [])}, reset=True)
    assert place(registry, index, policy, H, 170).worker.worker_id == "b"  # GPU beats host
    registry.on_load("b", 8, 2, 0.0)  # b is busy: host hits on an idle worker win
    assert place(registry, index, policy, H, 170).worker.worker_id == "a"
    registry.on_load("a", 8, 2, 0.0)
    decision = place(registry, index, policy, H, 170)
    assert decision.worker.worker_id == "c"  # a short prompt: the load outweighs the cache
    # ... and the decision says what it gave up: 10 blocks cached elsewhere, none here
    assert (decision.matched_blocks, decision.longest_blocks) == (0, 10)


def test_a_prefix_everyone_shares_does_not_draw_every_request_to_one_worker():
    """The H200 multi-turn run at 3.4 turns/s sent all 1000 turns to one worker of two:
    the 512-token system prompt it cached outweighed any load. A conversation's own
    history still keeps it where it is."""
    registry, index, policy = Registry(), KvIndex(), PlacementPolicy()
    for wid in ("a", "b"):
        registry.register(WorkerState(wid, f"{wid}:1", "colocated", 16, max_num_seqs=256))
    system = [hash(("system", i)) for i in range(32)]  # 512 tokens
    history = system + [hash(("history", i)) for i in range(282)]  # 5,024 tokens
    index.apply("a", 1, {GPU: (history, [])}, reset=True)
    assert place(registry, index, policy, system, 1935).worker.worker_id == "a"  # both idle
    registry.on_load("a", 16, 0, 0.3)
    registry.on_load("b", 0, 0, 0.0)
    new = place(registry, index, policy, system, 1935)  # a new conversation's first turn
    assert new.worker.worker_id == "b" and new.longest_blocks == 32
    assert place(registry, index, policy, history, 6448).worker.worker_id == "a"


def test_shared_hits_count_for_every_worker_and_ties_go_to_the_least_loaded():
    registry, index, policy = Registry(), KvIndex(), PlacementPolicy()
    worker(registry, "a", running=3)
    worker(registry, "b", running=1)
    index.apply(SHARED_HOLDER, 1, {SHARED: (H, [])}, reset=True)
    decision = place(registry, index, policy, H, 170)
    assert decision.worker.worker_id == "b" and decision.matched_blocks == 10


def test_placement_errors():
    registry, index, policy = Registry(), KvIndex(), PlacementPolicy()
    with pytest.raises(WorkerUnavailable):
        place(registry, index, policy, H, 170)
    worker(registry, "a", running=16)
    with pytest.raises(Saturated):
        place(registry, index, policy, H, 170)


def test_the_placement_benchmark_times_every_worker_count(tmp_path):
    """bench/placement.py at small sizes: a row per worker count, every request placed,
    next turns found on the worker that holds their history."""
    import json

    from bench.placement import main

    out = tmp_path / "placement.json"
    assert main(["--workers", "3,12", "--requests", "40", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["workers"] for r in rows] == [3, 12]
    for row in rows:
        assert row["requests"] == 40 and 0 < row["p50_us"] <= row["p99_us"] <= row["max_us"]
        # every prompt starts with the 32-block system prompt every worker holds
        assert row["mean_matched_blocks"] >= 32


def _random_index(rng, prompt, workers, holding: float = 1.0) -> KvIndex:
    """Each worker (one in `1 / holding` of them) holds random blocks of the prompt."""
    index = KvIndex()
    for w in workers:
        if rng.random() >= holding:
            index.apply(w, 0, {GPU: ([], [])}, reset=True)
            continue
        gpu = [h for h in prompt if rng.random() < 0.6]
        host = [h for h in prompt if rng.random() < 0.3]
        index.apply(w, 0, {GPU: (gpu, []), HOST: (host, [])}, reset=True)
        if rng.random() < 0.3:  # some leave the GPU tier
            index.apply(w, 1, {GPU: ([], [h for h in prompt if rng.random() < 0.3])})
    if rng.random() < 0.5:
        shared = [h for h in prompt if rng.random() < 0.7]
        index.apply(SHARED_HOLDER, 0, {SHARED: (shared, [])}, reset=True)
    return index


def test_prefix_groups_count_each_holder_as_its_own_walk_does():
    import random
    from collections import Counter

    for seed in range(400):
        rng = random.Random(seed)
        prompt = [rng.getrandbits(40) for _ in range(rng.randrange(0, 12))]
        workers = [f"w{i}" for i in range(rng.randrange(1, 7))]
        index = _random_index(rng, prompt, workers)
        if rng.random() < 0.3:  # one leaves and another comes (and may take its bit)
            index.forget(workers.pop(rng.randrange(len(workers))))
            workers.append(f"new{seed}")
            index.apply(workers[-1], 0, {GPU: ([h for h in prompt if rng.random() < 0.7], [])},
                        reset=True)  # fmt: skip
        asked = {w for w in workers if rng.random() < 0.8}
        got = {w: counts for counts, ids in index.prefix_groups(prompt, asked) for w in ids}
        tiers = {w: Counter(index.prefix_by_tier(w, prompt)) for w in asked}
        assert got == {w: (t[GPU], t[HOST], t[SHARED]) for w, t in tiers.items()}, seed


def test_placement_chooses_as_the_cost_of_each_worker_says():
    """The grouped walk chooses the worker that the cost formula, worker by worker,
    ranks first (ties: less loaded, then first registered)."""
    import random

    policy = PlacementPolicy()
    for seed in range(300):
        rng = random.Random(seed)
        prompt = [rng.getrandbits(40) for _ in range(rng.randrange(1, 10))]
        names = [f"w{i}" for i in range(rng.randrange(1, 8))]
        index, registry = _random_index(rng, prompt, names), Registry()
        for name in names:
            registry.register(WorkerState(name, "addr", "colocated", rng.choice([16, 32]), 4))
            registry.on_load(name, rng.randrange(0, 4), rng.randrange(0, 2),
                             rng.choice([0.0, 0.5]))  # fmt: skip
        tokens = len(prompt) * 32 + rng.randrange(0, 16)  # every block size's blocks

        def cost(w, index=index, prompt=prompt, tokens=tokens):
            tiers = index.prefix_by_tier(w.worker_id, prompt)
            work = max(tokens - len(tiers) * w.block_size, 0) + w.block_size * (
                tiers.count(HOST) * policy.host_hit_weight
                + tiers.count(SHARED) * policy.shared_hit_weight
            )
            load = w.load * policy.request_tokens + w.kv_usage * policy.memory_tokens
            return (work + load, w.load)

        workers = list(registry.workers.values())
        expected = min(workers, key=cost)
        decision = place(registry, index, policy, prompt, tokens)
        assert decision.worker is expected, seed
        longest = max(len(index.prefix_by_tier(w.worker_id, prompt)) for w in workers)
        assert decision.longest_blocks == longest, seed


@pytest.mark.parametrize(
    "workers, sizes, seed, registered, holding",
    [(12, (16, 32), 7, 0, 1.0), (80, (16,), 80, 40, 0.2)],  # the second: large groups
    ids=["12 workers", "80 workers, one block size"],
)
def test_placement_follows_reports_registrations_and_silence_as_reading_every_worker_would(
    workers, sizes, seed, registered, holding
):
    """Placement keeps its open workers and their loads as the registry tells each
    change (placement.OpenWorkers, with their KV-index bits and a load-ordered heap
    for large groups); after any mix of reports, placements, workers joining,
    leaving, going silent, at capacity, and KV indexes reset (their bits given out
    again), it chooses what reading every worker (`_open`, the path of a retry)
    chooses, and raises the same errors."""
    import random

    from services.common.placement import _best, _block_size, _loads, _open

    rng = random.Random(seed)
    now = [0.0]
    registry, policy = Registry(heartbeat_timeout=2.0, clock=lambda: now[0]), PlacementPolicy()
    prompt = [rng.getrandbits(40) for _ in range(6)]
    names = [f"w{i}" for i in range(workers)]
    index = _random_index(rng, prompt, names, holding)
    roles = ["colocated", "decode", "prefill"]
    for name in names[:registered]:
        registry.register(WorkerState(name, "addr", rng.choice(roles), rng.choice(sizes), 2))
    placed = errors = 0
    for step in range(1000 if workers < 20 else 1500):
        name, op = rng.choice(names), rng.random()
        if op < 0.15:
            registry.register(WorkerState(name, "addr", rng.choice(roles), rng.choice(sizes), 2))
        elif op < 0.2:
            registry.deregister(name)
        elif op < 0.5:
            registry.on_load(name, rng.randrange(0, 3), rng.randrange(0, 2), rng.random())
        elif op < 0.55:
            now[0] += rng.choice([0.5, 1.5])  # some go silent past the heartbeat timeout
        elif op < 0.57:
            registry.expire()
        elif op < 0.58:
            policy.request_tokens = rng.choice([32.0, 64.0])  # the weights change too
        elif op < 0.62:  # a worker's KV resynced: its bit freed and taken by another
            index.forget(name)
            index.apply(f"gone-{step}", 0, {GPU: (prompt[:2], [])}, reset=True)
            index.apply(name, 0, {GPU: ([h for h in prompt[:3] if rng.random() < 0.5], [])},
                        reset=True)  # fmt: skip
        else:
            roles = ("colocated", "decode")
            try:
                open_ = _open(registry, policy, roles, ())
            except (Saturated, WorkerUnavailable) as exc:
                with pytest.raises(type(exc)):
                    place(registry, index, policy, prompt, 100)
                errors += 1
                continue
            size, largest = _block_size({w.block_size for w in open_})
            tokens = max(100, len(prompt) * largest)
            expected, _ = _best(_loads(open_, policy), index, policy, prompt, tokens, size)
            assert place(registry, index, policy, prompt, 100).worker is expected, step
            placed += 1
    # many workers are seldom all at capacity or silent at once: the errors are the
    # small mesh's to check
    assert placed > 100 and errors > (10 if workers < 20 else 0), (placed, errors)


def test_the_open_workers_find_a_groups_least_loaded_in_load_order_or_say_to_read_it():
    from services.common.placement import _view

    registry, index, policy = Registry(), KvIndex(), PlacementPolicy()
    for i in range(40):
        registry.register(WorkerState(f"w{i}", "addr", "colocated", 16, 64))
        registry.on_load(f"w{i}", i % 7, 0, 0.0)
    view = _view(registry, policy, ("colocated", "decode"))
    everyone = view.mask_in(index)
    assert view.least_loaded(everyone) == min(view.loads.values())
    busy = [w for w in view.loads if registry.workers[w].running >= 5]  # 10 of them
    mask = 0
    for w in busy:
        mask |= index.bit_of(w)
    assert view.least_loaded(mask) == min(view.loads[w] for w in busy)
    assert view.least_loaded(mask, limit=3) is None  # 30 less loaded come first
    registry.placed(registry.workers[busy[0]])  # a change: its old entry is stale
    assert view.least_loaded(mask) == min(view.loads[w] for w in busy)


def test_a_worker_dropped_without_ever_reporting_is_named_so():
    """A worker whose load reports never arrive (another NATS, a wrong URL) is dropped
    like any silent one, and the log says it never reported and where to look."""
    now = [0.0]
    registry = Registry(heartbeat_timeout=2.0, clock=lambda: now[0])
    worker(registry, "talks")  # registered and reported once
    registry.register(WorkerState("mute", "mute:1", "colocated", block_size=16, max_num_seqs=8))
    now[0] = 2.5
    reasons = {w.worker_id: registry.why_dropped(w) for w in registry.expire()}
    assert reasons["talks"] == "no heartbeat for 2.0 s"
    assert reasons["mute"].startswith("no heartbeat for 2.0 s (none since it registered")
    assert "NATS" in reasons["mute"]
