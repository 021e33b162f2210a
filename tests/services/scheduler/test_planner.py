"""The SLA planner: a profile read between its rates, the rate predicted ahead,
corrections from what an interval of an unchanged fleet saw (never below the
profile), scaling down only when decisions agree;
driving a simulated mesh, it adds workers as a trace's rate triples and drains
them as it falls, losing no request; `yinian sim --planner-rate` writes its run."""

from __future__ import annotations

import json

import pytest

from basis.model_config import ModelConfig
from engine.make_model import preset_config
from engine.step_time_model import DeviceProfile, ModelCosts, StepTimeModel
from services.scheduler.planner import CapacityProfile, IntervalStats, PlannerConfig, SlaPlanner
from yinian.cli import main as yinian_main
from yinian.sim.cluster import SimConfig
from yinian.sim.planning import phased_trace, profile_worker, run_oracle, run_planned

PROFILE = CapacityProfile((10.0, 20.0, 40.0), (100.0, 200.0, 400.0), (10.0, 20.0, 40.0))


def test_the_profile_is_read_between_its_rates_and_never_past_them():
    assert PROFILE.at(5.0) == (100.0, 10.0)
    assert PROFILE.at(30.0) == pytest.approx((300.0, 30.0))
    assert PROFILE.at(41.0) == (float("inf"), float("inf"))
    with pytest.raises(ValueError, match="rising"):
        CapacityProfile((2.0, 1.0), (1.0, 1.0), (1.0, 1.0))
    with pytest.raises(ValueError, match="equally many"):
        CapacityProfile((1.0,), (1.0, 2.0), (1.0,))
    for bad in (dict(interval=0), dict(min_workers=3, max_workers=2), dict(headroom=1.5),
                dict(down_after=0), dict(correction_weight=0)):  # fmt: skip
        with pytest.raises(ValueError):
            PlannerConfig(**bad)


def test_the_planner_meets_a_rise_ahead_and_scales_down_only_when_it_agrees():
    config = PlannerConfig(interval=10.0, ttft_slo_ms=300.0, itl_slo_ms=30.0, max_workers=20,
                           horizon=2.0, down_after=2)  # fmt: skip
    planner = SlaPlanner(config, PROFILE)
    # 300 requests in 10 s on 2 workers: 15 req/s each, as the profile says; one
    # worker would do (30 req/s: at both SLOs), but one decision does not stop one
    first = planner.decide(IntervalStats(300, 150.0, 15.0, 2))
    assert planner.wanted == [1] and first.workers == 2
    assert (first.ttft_correction, first.itl_correction) == (1.0, 1.0)
    # the rate doubles: the trend carries the prediction two intervals ahead
    rising = planner.decide(IntervalStats(600, 300.0, 30.0, 2))  # as profiled at 30 a worker
    assert rising.predicted_rate == pytest.approx(60 + 0.5 * 30 * 2)
    assert rising.workers == planner.workers_for(rising.predicted_rate) == 3
    # a worker joined during this interval: what it saw mixes two fleets, and teaches
    # nothing, even with latencies three times the profile's
    joined = planner.decide(IntervalStats(600, 600.0, 60.0, 3))
    assert (joined.ttft_correction, joined.itl_correction) == (1.0, 1.0)
    # the same on the same three workers: the corrections move 0.3 of the way, more follow
    slow = planner.decide(IntervalStats(600, 600.0, 60.0, 3))
    assert (slow.ttft_correction, slow.itl_correction) == pytest.approx((1.6, 1.6))
    assert slow.workers > 3
    # the rate falls: fewer workers only once two decisions in a row ask for fewer
    now = slow.workers
    assert planner.decide(IntervalStats(100, 100.0, 10.0, now)).workers == now
    later = planner.decide(IntervalStats(100, 100.0, 10.0, now))
    assert later.workers < now


def test_latencies_below_the_profile_never_let_the_planner_plan_below_it():
    config = PlannerConfig(interval=10.0, ttft_slo_ms=300.0, itl_slo_ms=30.0, max_workers=20)
    planner = SlaPlanner(config, PROFILE)
    # 2 workers at 15 req/s each, half the profile's latencies: taken as the profile's
    light = planner.decide(IntervalStats(300, 75.0, 7.5, 2))
    assert (light.ttft_correction, light.itl_correction) == (1.0, 1.0)
    # slower than profiled, then faster again: the corrections come back down to 1
    slow = planner.decide(IntervalStats(300, 300.0, 30.0, 2))
    assert (slow.ttft_correction, slow.itl_correction) == pytest.approx((1.3, 1.3))
    back = planner.decide(IntervalStats(300, 75.0, 7.5, 2))
    assert (back.ttft_correction, back.itl_correction) == pytest.approx((1.21, 1.21))


@pytest.fixture(scope="module")
def sim():
    costs = ModelCosts.of(ModelConfig.from_dict(preset_config("llama3-8b")))
    profile = DeviceProfile.load("h200")
    config = SimConfig(workers=1, capacity_blocks=1455, service_ms=profile.service_ms)
    return config, StepTimeModel(costs, profile)


def test_the_planner_scales_a_simulated_mesh_up_and_down_and_loses_nothing(sim):
    config, model = sim
    profile = profile_worker(config, model, [2, 6, 10, 16, 24, 32, 40, 48], requests=200)
    assert len(profile.rates) >= 5 and profile.itl_p99_ms[-1] > profile.itl_p99_ms[0]
    requests = phased_trace(12.0, [(1.0, 60.0), (3.0, 90.0), (1.0, 90.0)], seed=1)
    plan = PlannerConfig(interval=10.0, ttft_slo_ms=500.0, itl_slo_ms=50.0, max_workers=16,
                         horizon=1.5, headroom=0.7)  # fmt: skip
    result = run_planned(config, model, SlaPlanner(plan, profile), requests, 5.0)
    serving = [row["serving"] for row in result.log]
    assert max(serving) >= 2 * min(serving[:5]) and serving[-1] < max(serving)
    assert result.refused == 0 and result.ttft_p99_ms is not None
    # its GPU time counts every worker powered, no more than the budget all along
    span = max(r.arrival for r in requests)
    assert min(serving) * span * 0.9 < result.gpu_seconds < plan.max_workers * span
    factor, oracle = run_oracle(config, model, plan, profile, requests, 5.0)
    assert oracle.within(plan) and factor >= 1.0


def test_yinian_sim_runs_the_planner_against_the_oracle(tmp_path, capsys):
    out = tmp_path / "plan"
    assert yinian_main(["sim", "--planner-rate", "3", "--out", str(out)]) == 0
    result = json.loads((out / "sim_planner.json").read_text())
    assert result["planner"]["refused"] == 0 and result["oracle"]["within_slos"]
    assert result["gpu_time_over_oracle"] > 0 and result["planner_log"]
    assert (out / "sim_planner.png").stat().st_size > 1000
    assert "GPU time over the oracle's" in capsys.readouterr().out
    assert yinian_main(["sim", "--planner-rate", "3", "--headroom", "0"]) == 2
    assert "--headroom" in capsys.readouterr().err
