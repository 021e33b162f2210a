"""The SLA planner (`services/scheduler/planner.py`) driving a simulated mesh:
one worker profiled first, then a trace whose rate changes, the planner deciding
every interval how many workers serve it (a started worker serves after
`start_seconds`; one let go is drained: it takes no new request and powers off
once it has finished what it holds), against an oracle that knows the trace.

GPU time counts every worker powered: serving, starting or draining."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from bench.loadgen.traces import make_trace
from services.scheduler.planner import (
    CapacityProfile,
    Decision,
    IntervalStats,
    PlannerConfig,
    SlaPlanner,
)
from yinian.sim.cluster import Cluster, SimConfig
from yinian.sim.report import pct
from yinian.sim.worker import SimRequest, entries_of, itls_ms, sim_requests, ttfts_ms

_PLAN, _STARTED = 10, 11


def phased_trace(rate: float, phases: list[tuple[float, float]], seed: int = 0):
    """Synthetic requests (`make_trace`'s conversations) whose conversation rate is
    `rate` times each phase's factor for the phase's seconds, phase after phase;
    each phase's conversations are its own (their blocks never another phase's)."""
    out, start = [], 0.0
    for k, (factor, seconds) in enumerate(phases):
        want = int(rate * factor * seconds * 3) + 10  # more than the phase can begin
        entries = [e for e in make_trace(want, rate * factor, seed=seed + k)
                   if e["timestamp"] < seconds * 1e3]  # fmt: skip
        for e in entries:  # the shared system prompts stay shared; the rest is the phase's
            e["hash_ids"] = [h if h < 8 else h + (k + 1) * 10**9 for h in e["hash_ids"]]
        out += sim_requests(entries_of(entries), start * 1e3, len(out))
        start += seconds
    return out


def profile_worker(config: SimConfig, model, rates: list[float], requests: int = 400,
                   seed: int = 0) -> CapacityProfile:  # fmt: skip
    """One worker sent each conversation rate in turn: its request rate and the TTFT
    and ITL p99 it served (a rate no worker keeps up with ends the profile)."""
    rows = []
    for rate in rates:
        reqs = sim_requests(entries_of(make_trace(requests, rate, seed=seed)))
        result = Cluster(replace(config, workers=1), model).run(reqs)
        done = result.requests
        span = max(r.arrival for r in reqs) - min(r.arrival for r in reqs)
        rows.append((len(reqs) / span, pct(ttfts_ms(done), 99), pct(itls_ms(done), 99)))
        if result.refused or len(done) < len(reqs):
            break
    rows.sort()
    return CapacityProfile(tuple(r[0] for r in rows), tuple(r[1] for r in rows),
                           tuple(r[2] for r in rows))  # fmt: skip


class PlannedCluster(Cluster):
    def __init__(self, config: SimConfig, model, planner: SlaPlanner, start_seconds: float):
        super().__init__(config, model)
        self.planner, self.start_seconds = planner, start_seconds
        self.log: list[dict] = []
        self._arrivals: list[float] = []
        self._seen = 0  # requests of `finished` already counted
        self.cancelled = 0  # of the workers starting, those no longer wanted

    def run(self, requests: list[SimRequest]):
        self._arrivals = sorted(r.arrival for r in requests)
        last = self._arrivals[-1] if self._arrivals else 0.0
        interval = self.planner.config.interval
        for k in range(1, int(last // interval) + 1):
            self._push(k * interval, _PLAN, None)
        return super().run(requests)

    def on_event(self, kind: int, payload) -> None:
        if kind == _STARTED:
            self.starting -= 1
            if self.cancelled:  # let go while it started: it never joins
                self.cancelled -= 1
            else:
                self.add_worker()
            return
        interval = self.planner.config.interval
        came = np.searchsorted(self._arrivals, self.now) - np.searchsorted(
            self._arrivals, self.now - interval
        )
        new = self.finished[self._seen :]
        self._seen = len(self.finished)
        serving = len(self.registry.workers)
        stats = IntervalStats(
            int(came),
            pct(ttfts_ms(new), 99),
            pct(itls_ms(new), 99),
            serving,
        )
        decision = self.planner.decide(stats)
        self._scale(decision.workers)
        self.log.append({"t": self.now, "requests": stats.requests, "serving": serving,
                         "target": decision.workers, "predicted_rate": decision.predicted_rate,
                         "ttft_p99_ms": stats.ttft_p99_ms, "itl_p99_ms": stats.itl_p99_ms,
                         "p": decision.ttft_correction, "d": decision.itl_correction})  # fmt: skip

    def _scale(self, target: int) -> None:
        coming = self.starting - self.cancelled
        have = len(self.registry.workers) + coming
        if target > have:
            revived = min(self.cancelled, target - have)  # a start let go is wanted again
            self.cancelled -= revived
            for _ in range(target - have - revived):
                self.starting += 1
                self._push(self.now + self.start_seconds, _STARTED, None)
        elif target < have:  # the starts first, then the least loaded serving
            stop = min(coming, have - target)
            self.cancelled += stop
            states = sorted(self.registry.workers.values(), key=lambda w: w.load)
            for state in states[: have - target - stop]:
                self.drain_worker(state.worker_id)


def interval_rates(requests: list[SimRequest], interval: float) -> list[float]:
    """Each interval's true request rate."""
    arrivals = np.array(sorted(r.arrival for r in requests))
    intervals = math.ceil((arrivals[-1] + 1e-9) / interval) if len(arrivals) else 0
    counts = np.bincount((arrivals // interval).astype(int), minlength=intervals)
    return [float(c) / interval for c in counts[:intervals]]


class OraclePlanner(SlaPlanner):
    """Knows the trace: each interval, the workers the profile (times a fixed
    correction `factor` on both latencies, at the whole SLOs) gives for the true
    rate of the coming interval and of the interval a worker started now would
    first serve (so it starts them that far ahead, paying for their start)."""

    def __init__(self, config: PlannerConfig, profile: CapacityProfile, rates, factor: float,
                 lead: int):  # fmt: skip
        super().__init__(replace(config, headroom=1.0), profile, p=factor, d=factor)
        self.rates, self.k, self.lead = rates, 0, lead

    def decide(self, stats: IntervalStats) -> Decision:
        self.k += 1
        ahead = self.rates[self.k : self.k + self.lead + 1] or self.rates[-1:]
        rate = max(ahead)
        decision = Decision(self.workers_for(rate), rate, self.p, self.d)
        self.decisions.append(decision)
        return decision


@dataclass
class PlanResult:
    gpu_seconds: float
    ttft_p99_ms: float | None
    itl_p99_ms: float | None
    refused: int
    log: list[dict]

    def within(self, config: PlannerConfig) -> bool:
        return (self.refused == 0 and self.ttft_p99_ms is not None
                and self.ttft_p99_ms <= config.ttft_slo_ms
                and self.itl_p99_ms <= config.itl_slo_ms)  # fmt: skip


def run_planned(config: SimConfig, model, planner: SlaPlanner, requests: list[SimRequest],
                start_seconds: float) -> PlanResult:  # fmt: skip
    """The trace on a mesh that starts with the workers the first interval needs
    (by the planner's profile: both the planner and the oracle know the load at
    the start) and then follows the planner."""
    first = interval_rates(requests, planner.config.interval)[0]
    start = replace(config, workers=planner.workers_for(first))
    cluster = PlannedCluster(start, model, planner, start_seconds)
    result = cluster.run(requests)
    done = result.requests
    return PlanResult(
        cluster.gpu_seconds,
        pct(ttfts_ms(done), 99),
        pct(itls_ms(done), 99),
        result.refused + result.too_long,
        cluster.log,
    )


FACTORS = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0)


def run_oracle(config: SimConfig, model, planner_config: PlannerConfig,
               profile: CapacityProfile, requests: list[SimRequest], start_seconds: float,
               factors=FACTORS) -> tuple[float, PlanResult]:  # fmt: skip
    """The oracle with the least correction whose run keeps the SLOs (the last
    tried when none does): (that factor, its run)."""
    interval = planner_config.interval
    rates = interval_rates(requests, interval)
    lead = math.ceil(start_seconds / interval)
    for factor in factors:
        oracle = OraclePlanner(planner_config, profile, rates, factor, lead)
        result = run_planned(config, model, oracle, requests, start_seconds)
        if result.within(planner_config):
            break
    return factor, result
