"""`yinian up --planner-profile FILE`: the SLA planner (services/scheduler/planner.py)
scales the mesh's colocated workers while it serves.

Every `--planner-interval` seconds the planner is told what the gateways' own
metrics saw in that interval (requests that arrived: finished plus the change in
those in flight; TTFT and ITL p99 from their histograms' buckets) and how many
workers served; it answers how many the next interval needs, between
`--min-workers` and `--max-workers`. More are started (each a new `worker-N`,
placed on once it registers); fewer are stopped the newest first, each draining
its streams (what is left after the drain timeout moves to another worker), so
no request is lost. Each decision is a line of JSON in the log folder's
`planner.jsonl` and, when it changes the count, a line on the console.

The profile is one worker's p99s at each rate: the `-sweep.json` that `yinian bench
serve --request-rates R1,R2,... --save-result` wrote against a mesh of one worker."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.scheduler.planner import CapacityProfile, IntervalStats, PlannerConfig, SlaPlanner
from yinian.mesh import Mesh


def add_autoscale_args(p) -> None:
    g = p.add_argument_group("autoscaling (the SLA planner scales the colocated workers)")
    g.add_argument(
        "--planner-profile",
        metavar="SWEEP_JSON",
        help="turns the planner on: one worker's capacity, the -sweep.json of "
        "`yinian bench serve --request-rates ...` against a mesh of one worker",
    )
    g.add_argument("--max-workers", type=int, default=4, help="the most colocated workers")
    g.add_argument("--min-workers", type=int, default=1, help="the fewest colocated workers")
    g.add_argument(
        "--planner-interval",
        type=float,
        default=30.0,
        help="seconds between the planner's decisions",
    )
    g.add_argument("--ttft-slo-ms", type=float, default=500.0, help="TTFT p99 to keep within")
    g.add_argument("--itl-slo-ms", type=float, default=50.0, help="ITL p99 to keep within")


def planner_of(args) -> SlaPlanner | None:
    """The planner `yinian up`'s flags ask for (None without --planner-profile); a
    ValueError for flags or a profile that cannot work, before anything starts."""
    if not args.planner_profile:
        return None
    if getattr(args, "prefill", 0) or getattr(args, "decode", 0):
        raise ValueError("the planner scales colocated workers: leave out --prefill/--decode")
    try:
        runs = json.loads(Path(args.planner_profile).read_text())["runs"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--planner-profile {args.planner_profile}: not a bench serve "
                         f"sweep result ({exc})") from exc  # fmt: skip
    config = PlannerConfig(interval=args.planner_interval, ttft_slo_ms=args.ttft_slo_ms,
                           itl_slo_ms=args.itl_slo_ms, min_workers=args.min_workers,
                           max_workers=args.max_workers)  # fmt: skip
    return SlaPlanner(config, CapacityProfile.from_runs(runs))


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The q-quantile of a histogram's cumulative (upper bound, count) buckets, linear
    within the bucket it falls in (as Prometheus' histogram_quantile); None if empty."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


def _empty() -> dict:
    """Requests finished and in flight, and each histogram's buckets (bound -> count)."""
    return {"finished": 0.0, "in_flight": 0.0, "ttft": {}, "itl": {}}


def _read(text: str) -> dict:
    """What the planner needs of one gateway's /metrics page."""
    out = _empty()
    histograms = {"yinian:time_to_first_token_seconds": "ttft",
                  "yinian:inter_token_latency_seconds": "itl"}  # fmt: skip
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "yinian:request_total":
                out["finished"] += sample.value
            elif sample.name == "yinian:gateway_requests_in_flight":
                out["in_flight"] += sample.value
            elif sample.name.endswith("_bucket") and sample.name[: -len("_bucket")] in histograms:
                which = out[histograms[sample.name[: -len("_bucket")]]]
                bound = float(sample.labels["le"])
                which[bound] = which.get(bound, 0.0) + sample.value
    return out


class GatewayWindow:
    """The gateways' metrics, read once an interval; `next` gives what changed since.
    `urls` is the gateways' base URLs, or a function that lists them afresh each
    interval (pods come and go): each gateway counts from its own last page, so one
    first seen counts from then on (one that drops out of the list and comes back
    too: its requests of that interval are not counted), one gone counts no more, and
    one whose counters went back (a restart) counts from zero."""

    def __init__(self, urls: list[str] | Callable[[], list[str]], verify=True,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.urls, self.verify, self.clock = urls, verify, clock
        self.last, self.at = self._scrape(), clock()

    def _scrape(self) -> dict[str, dict]:
        urls = self.urls() if callable(self.urls) else self.urls
        return {url: _read(httpx.get(f"{url}/metrics", timeout=5, verify=self.verify).text)
                for url in urls}  # fmt: skip

    def next(self, workers: int, interval: float) -> IntervalStats:
        """The interval since the last call, its request count scaled to `interval`
        seconds (the planner's unit) if it ran longer or shorter."""
        now, seen = self.clock(), self._scrape()
        last, self.last, elapsed, self.at = self.last, seen, now - self.at, now
        arrived, buckets = 0.0, {"ttft": {}, "itl": {}}
        for url, page in seen.items():
            before = last.get(url, page)  # first seen: its history is not this interval's
            if page["finished"] < before["finished"]:  # restarted: its counters anew
                before = _empty()
            arrived += page["finished"] - before["finished"] + page["in_flight"]
            arrived -= before["in_flight"]
            for key in buckets:
                for bound, count in page[key].items():
                    change = count - before[key].get(bound, 0.0)
                    buckets[key][bound] = buckets[key].get(bound, 0.0) + change

        def p99_ms(key: str) -> float | None:
            value = quantile(sorted(buckets[key].items()), 0.99)
            return None if value is None else value * 1e3

        requests = round(max(arrived, 0.0) * interval / max(elapsed, 1e-9))
        return IntervalStats(requests, p99_ms("ttft"), p99_ms("itl"), workers)


class MeshWorkers:
    """The actuator on a mesh of this machine. Workers are started from the calling
    thread (a child dies with the thread that started it: call from one that lives as
    long as the mesh) and waited for, or stopped (a drain), in the background."""

    def __init__(self, mesh: Mesh, say: Callable[[str], None]):
        self.mesh, self.say = mesh, say

    def names(self) -> list[str]:
        return sorted((c.name for c in self.mesh.children if c.name.startswith("worker-")),
                      key=lambda n: int(n.split("-")[1]))  # fmt: skip

    def serving(self) -> int:
        """Workers ready now."""
        return sum(self.mesh.child(n).ready.is_set() for n in self.names())

    def count(self) -> int:
        """Workers serving or starting."""
        return len(self.names())

    def scale_to(self, wanted: int) -> None:
        names = self.names()
        for _ in range(wanted - len(names)):
            try:
                child = self.mesh.add_worker()
            except Exception as exc:  # the next decision sees one worker fewer
                self.say(f"planner: a worker did not start: {exc}")
                return
            threading.Thread(target=self._wait, args=(child,), daemon=True).start()
        for name in names[::-1][: max(len(names) - wanted, 0)]:
            self.say(f"planner: stopping {name} (it drains its streams)")
            threading.Thread(target=self._remove, args=(name,), daemon=True).start()

    def _wait(self, child) -> None:
        try:
            self.mesh.wait_worker(child)
            self.say(f"planner: {child.name} started")
        except Exception as exc:
            self.say(f"planner: {child.name} did not start: {exc}")

    def _remove(self, name: str) -> None:
        self.mesh.remove_worker(name)
        self.say(f"planner: {name} stopped")


class Autoscaler:
    """Every interval: the gateways' figures to the planner, its decision to the mesh."""

    def __init__(self, planner: SlaPlanner, window: GatewayWindow, workers: MeshWorkers,
                 log: Path, say: Callable[[str], None]):  # fmt: skip
        self.planner, self.window, self.workers = planner, window, workers
        self.log, self.say = log, say

    def run(self, stop: threading.Event) -> None:
        interval = self.planner.config.interval
        while not stop.wait(interval):
            try:
                self.tick()
            except httpx.HTTPError as exc:  # a gateway restarting: decide next time
                self.say(f"planner: metrics unreadable this interval ({exc})")
            except Exception as exc:  # the mesh keeps serving at its size; said, not hidden
                self.say(f"planner: this interval failed: {exc!r}")

    def tick(self) -> None:
        stats = self.window.next(self.workers.serving(), self.planner.config.interval)
        decision = self.planner.decide(stats)
        have = self.workers.count()
        with self.log.open("a") as f:
            f.write(json.dumps({"time": time.time(), "requests": stats.requests,
                                "ttft_p99_ms": stats.ttft_p99_ms, "itl_p99_ms": stats.itl_p99_ms,
                                "serving": stats.workers, "workers": have,
                                "decided": decision.workers,
                                "predicted_rate": decision.predicted_rate,
                                "ttft_correction": decision.ttft_correction,
                                "itl_correction": decision.itl_correction}) + "\n")  # fmt: skip
        # more than serving and starting, or fewer than serving (a worker still starting
        # was asked for by an earlier decision: the planner's rule for fewer waits for
        # decisions that agree, over the workers it saw serving)
        if decision.workers > have or decision.workers < stats.workers:
            self.say(f"planner: {decision.predicted_rate:.2f} req/s ahead; workers "
                     f"{have} -> {decision.workers}")  # fmt: skip
            self.workers.scale_to(decision.workers)


def start_autoscaler(mesh: Mesh, planner: SlaPlanner, stop: threading.Event,
                     say: Callable[[str], None]) -> threading.Thread:  # fmt: skip
    window = GatewayWindow(mesh.urls, verify=mesh.ssl_context() or True)
    scaler = Autoscaler(planner, window, MeshWorkers(mesh, say), mesh.log_dir / "planner.jsonl",
                        say)  # fmt: skip
    thread = threading.Thread(target=scaler.run, args=(stop,), name="planner", daemon=True)
    thread.start()
    return thread
