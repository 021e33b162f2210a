"""The SLA planner: how many workers the next interval needs, after the method of
Dynamo's SLA planner, for colocated workers.

Before it runs, a profile of one worker: at each request rate it was sent, the
TTFT and ITL p99 it served (`CapacityProfile`; `yinian sim` makes one by sending
a simulated worker a rising rate, a real mesh's would come from `yinian bench
serve` against one worker). Every interval the planner is told what the last
interval saw (requests, TTFT and ITL p99, workers); it

1. predicts the request rate `horizon` intervals ahead (Holt's linear trend over
   the intervals so far; a rise only: a horizon past the next interval covers the
   time a new worker takes to start, while stopping one is at once);
2. corrects the profile by what it saw: p = observed TTFT p99 / the profile's at
   the observed rate a worker, d the same for ITL, each within [1, 4] and moved
   `correction_weight` of the way from the last (one noisy interval cannot swing
   the fleet). Only an interval that ends with as many workers serving as the
   one before teaches: one in which workers joined or left mixes two fleets, the
   overload before a start with the relief after it. Never below 1: the profile is
   one worker under a steady load; a fleet serving a light load can look better
   than that, and a correction learnt there would stop workers the next rise needs;
3. chooses the fewest workers, within [min, max], whose predicted rate a worker
   the profile, times the corrections, serves within both SLOs (times the
   headroom, the share of each SLO aimed at); fewer workers
   than now only once `down_after` decisions in a row asked for fewer (the
   largest of them), so that a dip does not stop workers a rise then restarts.

It decides; an actuator (the simulator's cluster, `yinian up`'s supervisor, a
Kubernetes Deployment's scale) carries the decision out."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CapacityProfile:
    """One worker's p99 latencies (ms) at each request rate (req/s), rates rising."""

    rates: tuple[float, ...]
    ttft_p99_ms: tuple[float, ...]
    itl_p99_ms: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.rates or len({len(self.rates), len(self.ttft_p99_ms),
                                  len(self.itl_p99_ms)}) != 1:  # fmt: skip
            raise ValueError("a capacity profile needs equally many rates and latencies")
        if any(b <= a for a, b in zip(self.rates, self.rates[1:])) or self.rates[0] <= 0:
            raise ValueError("a capacity profile's rates must be > 0 and rising")

    @classmethod
    def from_runs(cls, runs: list[dict]) -> CapacityProfile:
        """From the runs of a `yinian bench serve --request-rates ...` sweep against one
        worker (their request_rate, p99_ttft_ms, p99_itl_ms); a run with failed requests,
        no latencies or an unbounded rate is left out."""
        rows = sorted(
            (r["request_rate"], r["p99_ttft_ms"], r["p99_itl_ms"])
            for r in runs
            if not r.get("failed") and math.isfinite(r.get("request_rate", math.inf))
            and r.get("p99_ttft_ms") is not None and r.get("p99_itl_ms") is not None
        )  # fmt: skip
        if not rows:
            raise ValueError("a capacity profile needs runs at finite rates with no failures")
        return cls(*(tuple(col) for col in zip(*rows)))

    def at(self, rate: float) -> tuple[float, float]:
        """(TTFT p99, ITL p99) at `rate` a worker: linear between the profiled rates,
        the first below them; past the last, infinite (never profiled: never chosen)."""
        if rate <= self.rates[0]:
            return self.ttft_p99_ms[0], self.itl_p99_ms[0]
        if rate > self.rates[-1]:
            return math.inf, math.inf
        k = bisect.bisect_left(self.rates, rate)
        lo, hi = self.rates[k - 1], self.rates[k]
        w = (rate - lo) / (hi - lo)
        ttft = self.ttft_p99_ms[k - 1] + w * (self.ttft_p99_ms[k] - self.ttft_p99_ms[k - 1])
        itl = self.itl_p99_ms[k - 1] + w * (self.itl_p99_ms[k] - self.itl_p99_ms[k - 1])
        return ttft, itl


@dataclass
class PlannerConfig:
    interval: float = 30.0  # seconds between decisions
    ttft_slo_ms: float = 500.0
    itl_slo_ms: float = 50.0
    min_workers: int = 1
    max_workers: int = 64
    trend: float = 0.5  # Holt's trend smoothing (the level follows the last interval)
    horizon: float = 1.0  # intervals ahead to predict
    down_after: int = 2  # decisions in a row below the workers serving, to scale down
    headroom: float = 1.0  # aim at this share of each SLO (below 1: room for a surprise)
    correction_weight: float = 0.3  # how far one interval moves the corrections

    def __post_init__(self) -> None:
        if self.interval <= 0 or self.ttft_slo_ms <= 0 or self.itl_slo_ms <= 0:
            raise ValueError("the planner's interval and SLOs must be > 0")
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError("the planner needs 1 <= min_workers <= max_workers")
        if not 0.0 <= self.trend <= 1.0:
            raise ValueError("the planner's trend smoothing must be in [0, 1]")
        if self.horizon <= 0 or self.down_after < 1:
            raise ValueError("the planner's horizon must be > 0 and down_after >= 1")
        if not 0.0 < self.headroom <= 1.0:
            raise ValueError("the planner's headroom must be in (0, 1]")
        if not 0.0 < self.correction_weight <= 1.0:
            raise ValueError("the planner's correction weight must be in (0, 1]")


@dataclass(frozen=True)
class IntervalStats:
    """What an interval saw: requests that arrived, the p99s of those that got
    their first token / finished in it (None: none did), the workers serving."""

    requests: int
    ttft_p99_ms: float | None
    itl_p99_ms: float | None
    workers: int


@dataclass
class Decision:
    workers: int
    predicted_rate: float
    ttft_correction: float
    itl_correction: float


_CLAMP = (1.0, 4.0)


def _clamp(x: float) -> float:
    return min(max(x, _CLAMP[0]), _CLAMP[1])


@dataclass
class SlaPlanner:
    config: PlannerConfig
    profile: CapacityProfile
    level: float | None = None
    slope: float = 0.0
    p: float = 1.0
    d: float = 1.0
    decisions: list[Decision] = field(default_factory=list)
    wanted: list[int] = field(default_factory=list)  # what each interval's figures asked
    last_workers: int | None = None  # serving at the last decision (None: none yet)

    def decide(self, stats: IntervalStats) -> Decision:
        rate = stats.requests / self.config.interval
        if self.level is None:
            self.level = rate
        else:
            last = self.level
            self.level = rate
            self.slope = self.config.trend * (rate - last) + (1 - self.config.trend) * self.slope
        # a rise is met ahead (a new worker takes time to start); a fall is not
        # anticipated (stopping a worker is at once)
        predicted = max(0.0, self.level + max(self.slope, 0.0) * self.config.horizon)
        steady = self.last_workers in (None, stats.workers)
        self.last_workers = stats.workers
        if steady and stats.workers and rate > 0:
            expected_ttft, expected_itl = self.profile.at(rate / stats.workers)
            w = self.config.correction_weight
            if stats.ttft_p99_ms is not None and math.isfinite(expected_ttft):
                self.p += w * (_clamp(stats.ttft_p99_ms / expected_ttft) - self.p)
            if stats.itl_p99_ms is not None and math.isfinite(expected_itl):
                self.d += w * (_clamp(stats.itl_p99_ms / expected_itl) - self.d)
        wanted = self.workers_for(predicted)
        self.wanted.append(wanted)
        if stats.workers and wanted < stats.workers:
            recent = self.wanted[-self.config.down_after :]
            if len(recent) < self.config.down_after or max(recent) >= stats.workers:
                wanted = stats.workers  # not yet: the last decisions did not all agree
            else:
                wanted = max(recent)
        decision = Decision(wanted, predicted, self.p, self.d)
        self.decisions.append(decision)
        return decision

    def workers_for(self, rate: float) -> int:
        """The fewest workers (within the bounds) that serve `rate` within the SLOs,
        by the profile times the corrections."""
        c = self.config
        ttft_goal, itl_goal = c.ttft_slo_ms * c.headroom, c.itl_slo_ms * c.headroom
        for n in range(c.min_workers, c.max_workers + 1):
            ttft, itl = self.profile.at(rate / n)
            if ttft * self.p <= ttft_goal and itl * self.d <= itl_goal:
                return n
        return c.max_workers
