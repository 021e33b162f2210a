"""`yinian sim`: the simulated block pool and worker keep the engine's rules and
the device model's times; the scheduler's own placement, fed by the simulated
workers' KV events, sends a prompt to the worker that caches it; the command
replays a trace and says what it saw."""

from __future__ import annotations

import json

import pytest
from paths import ROOT

from basis.model_config import ModelConfig
from bench.loadgen.traces import read_trace
from engine.make_model import preset_config
from engine.step_time_model import DeviceProfile, ModelCosts, StepTimeModel
from services.common.placement import PlacementPolicy
from yinian.cli import main as yinian_main
from yinian.sim.block_pool import BlockPool
from yinian.sim.cluster import Cluster, SimConfig
from yinian.sim.worker import SimRequest, SimWorker, sim_requests

TRACE = ROOT / "bench" / "loadgen" / "data" / "mooncake_small.jsonl"


@pytest.fixture(scope="module")
def model() -> StepTimeModel:
    costs = ModelCosts.of(ModelConfig.from_dict(preset_config("llama3-8b")))
    return StepTimeModel(costs, DeviceProfile.load("h200"))


def test_the_pool_shares_cached_blocks_evicts_the_oldest_idle_and_says_so():
    pool = BlockPool(6)
    assert pool.admit((1, 2), 0, 3)  # a prompt of two blocks and an output block
    pool.prompt_done((1, 2), 0)
    assert pool.take_events() == ([1, 2], []) and pool.cached_prefix((1, 2, 9)) == 2
    pool.release((1, 2), 2, 3)
    assert pool.available() == 6 and pool.used() == 0.0
    assert pool.admit((1, 2, 3), 2, 4)  # shares 1 and 2, takes two new blocks
    assert pool.free == 2 and pool.available() == 2
    assert not pool.admit((7, 8, 9), 0, 3)  # does not fit: nothing changes
    assert pool.free == 2 and pool.take_events() == ([], [])
    pool.prompt_done((1, 2, 3), 2)
    pool.release((1, 2, 3), 3, 4)
    assert pool.admit((5,), 0, 5)  # 3 free, then the two oldest idle blocks go
    assert pool.take_events() == ([3], [1, 2]) and pool.cached_prefix((1, 2, 3)) == 0


def test_a_worker_steps_take_the_device_models_time(model):
    worker = SimWorker("w", model, capacity_blocks=100, block_tokens=512)
    worker.add(SimRequest(0, 0.0, 1024, 4, (11, 12)))
    seconds = worker.start_step()
    assert seconds == pytest.approx(model.seconds([(1024, 0)]))
    assert worker.end_step(seconds) == [] and worker.running == 1
    decode = worker.start_step()
    assert decode == pytest.approx(model.seconds([(1, 1024)]))  # the first token's row
    now = seconds
    for _ in range(3):
        now += worker.start_step()
        done = worker.end_step(now)
    assert [r.rid for r in done] == [0] and worker.output_tokens == 4
    r = done[0]
    assert r.first_token == pytest.approx(seconds) and r.finished == pytest.approx(now)
    assert not worker.has_work() and worker.pool.used() == 0.0
    # the same prompt again: its first block comes from the cache (the last is
    # computed, so the first token has logits), and the step is shorter
    worker.add(SimRequest(1, now, 1024, 2, (11, 12)))
    again = worker.start_step()
    assert worker.prefilling[0].computed == 512
    assert again == pytest.approx(model.seconds([(512, 512)])) and again < seconds


def test_prompts_wait_for_a_sequence_slot_and_share_the_steps_token_budget(model):
    worker = SimWorker("w", model, capacity_blocks=100, block_tokens=512, max_num_seqs=2,
                       max_num_batched_tokens=1000)  # fmt: skip
    for i in range(3):
        worker.add(SimRequest(i, 0.0, 600, 2, (100 + i, 200 + i)))
    first = worker.start_step()
    assert [r.rid for r in worker.prefilling] == [0, 1] and len(worker.waiting) == 1
    assert first == pytest.approx(model.step_seconds(0, 0, [(600, 0), (400, 0)]))
    worker.end_step(first)
    assert [r.todo for r in worker.prefilling] == [200]  # request 0 decodes now


def cluster_of(model, workers: int, placement: str = "kv") -> Cluster:
    config = SimConfig(workers=workers, placement=placement, capacity_blocks=200,
                       kv_interval=0.0, load_interval=0.0)  # fmt: skip
    return Cluster(config, model)


def test_the_schedulers_placement_follows_the_prefix_its_index_learned(model):
    cluster = cluster_of(model, 8)
    # one conversation's turns, far apart: each next turn carries the history
    turns = [SimRequest(i, 10.0 * i, 1024 * (i + 1), 8, tuple(range(2 * (i + 1))))
             for i in range(4)]  # fmt: skip
    result = cluster.run(turns)
    assert len({r.worker for r in result.requests}) == 1  # every turn where its history is
    assert result.refused == 0 and result.too_long == 0
    rr = cluster_of(model, 8, "round-robin").run(
        [SimRequest(i, 10.0 * i, 1024 * (i + 1), 8, tuple(range(2 * (i + 1)))) for i in range(4)]
    )
    assert len({r.worker for r in rr.requests}) == 4  # in turn, history or not
    hits = [sum(w.cached_tokens for w in res.workers) for res in (result, rr)]
    assert hits[0] == 1024 * (1 + 2 + 3) and hits[1] == 0


def test_a_saturated_mesh_refuses_and_a_prompt_no_pool_holds_is_counted(model):
    config = SimConfig(workers=1, capacity_blocks=4, max_num_seqs=1)
    requests = [SimRequest(i, 0.0, 512, 64, (i,)) for i in range(4)]
    requests.append(SimRequest(9, 0.0, 4096, 8, tuple(range(50, 58))))  # 9 blocks > 4
    result = Cluster(config, model).run(requests)
    # capacity 2 (one running, one waiting): the other two arrive while both are held
    assert len(result.requests) == 2 and result.refused == 2 and result.too_long == 1
    with pytest.raises(ValueError, match="placement"):
        SimConfig(workers=2, placement="random")


def test_yinian_sim_replays_a_trace_and_writes_its_figures(tmp_path, capsys):
    out = tmp_path / "sim"
    assert yinian_main(["sim", "--trace", str(TRACE), "--workers", "4,8", "--placement",
                        "kv,round-robin", "--out", str(out)]) == 0  # fmt: skip
    result = json.loads((out / "sim.json").read_text())
    runs = {(r["workers"], r["placement"]): r for r in result["runs"]}
    assert set(runs) == {(4, "kv"), (4, "round-robin"), (8, "kv"), (8, "round-robin")}
    for row in runs.values():
        assert row["requests_finished"] + row["requests_refused"] == 120
        assert row["ttft_ms"]["p50"] > 0 and row["placement_us"]["p99"] > 0
    assert runs[(8, "kv")]["kv_hit_rate"] > runs[(8, "round-robin")]["kv_hit_rate"]
    assert result["plots"] == ["sim.png"]
    assert all((out / p).stat().st_size > 1000 for p in result["plots"])
    assert "8 workers" in capsys.readouterr().out


def test_yinian_sim_refuses_what_it_cannot_run(tmp_path, capsys):
    for argv, what in (
        (["--workers", "0", "--synthetic-per-worker", "5"], "--workers"),
        (["--workers", "2", "--placement", "random", "--synthetic-per-worker", "5"], "--placement"),
        (["--workers", "2"], "--trace or --synthetic"),
        (["--trace", str(TRACE), "--synthetic-per-worker", "5"], "--trace or --synthetic"),
    ):
        assert yinian_main(["sim", *argv]) == 2
        assert what in capsys.readouterr().err


def test_the_synthetic_trace_keeps_its_rate_to_the_end():
    # conversations keep coming until the entries asked for have begun: the last
    # stretch of the trace is as busy as the rest (it used to thin out, every
    # conversation's later turns trailing behind the last first turn)
    from bench.loadgen.traces import make_trace

    stamps = [e["timestamp"] for e in make_trace(3000, rate=20.0, seed=3)]
    assert len(stamps) == 3000 and stamps == sorted(stamps)
    span = stamps[-1] - stamps[0]
    tenths = [sum(1 for t in stamps if k * span / 10 <= t - stamps[0] < (k + 1) * span / 10)
              for k in range(10)]  # fmt: skip
    assert min(tenths[5:]) > 0.8 * max(tenths[5:]), tenths
    assert tenths[9] >= tenths[0], tenths


def test_the_sim_takes_the_schedulers_placement_weights(model):
    # a cached system prompt draws a conversation to its worker while that worker is
    # fewer than request_tokens-worth of requests busier: with a heavy weight, load wins
    # the first prompt is cached (and its KV events in) before the others come
    requests = [SimRequest(i, 1.0 * bool(i) + 0.001 * i, 1024, 400, (1, 2)) for i in range(6)]
    light = Cluster(SimConfig(workers=3, kv_interval=0.0, load_interval=0.0), model).run(
        [SimRequest(r.rid, r.arrival, r.input_len, r.output_len, r.hashes) for r in requests]
    )
    heavy_policy = PlacementPolicy(request_tokens=4096.0)
    heavy = Cluster(SimConfig(workers=3, kv_interval=0.0, load_interval=0.0,
                              policy=heavy_policy), model).run(requests)  # fmt: skip
    assert len({r.worker for r in light.requests}) == 1
    assert len({r.worker for r in heavy.requests}) == 3


def test_a_fixed_placement_time_makes_a_run_repeat_exactly(model):
    """--placement-ms: each placement takes that long on the simulation's clock, so two
    runs of one trace are the same run (measured times shift events a little)."""

    def run():
        config = SimConfig(workers=4, placement_ms=0.05)
        requests = sim_requests(read_trace(TRACE))
        result = Cluster(config, model).run(requests)
        return [(r.worker, r.first_token, r.finished) for r in result.requests]

    first = run()
    assert first and first == run()
    with pytest.raises(ValueError, match="placement_ms"):
        SimConfig(workers=1, placement_ms=-1.0)
