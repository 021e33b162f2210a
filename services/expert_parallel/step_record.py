"""What one step's expert traffic cost on a worker: (token, expert) pairs sent
and kept, time issuing dispatches, time combines waited, and how much of the
round trips other work hid (the overlap ping-pong micro-batches buy). Ends in
the Prometheus metrics, one span per step with dispatch and combine children,
and running totals (`totals`) for tests and benchmarks."""

from __future__ import annotations

import threading
import time

from opentelemetry import trace

from services.common.spans import epoch_ns
from services.expert_parallel import metrics


class StepRecord:
    def __init__(self, worker_id: str, tracer=None):
        self.worker_id = worker_id
        self.tracer = tracer
        self._lock = threading.Lock()
        self.totals = {
            "steps": 0, "remote_pairs": 0, "local_pairs": 0, "dispatches": 0,
            "combines_ready": 0, "combines": 0, "dispatch_seconds": 0.0,
            "wait_seconds": 0.0, "round_trip_seconds": 0.0, "fallbacks": 0,
        }  # fmt: skip
        self._reset()

    def _reset(self) -> None:
        self.started = time.monotonic()
        self.version = 0
        self.step = dict.fromkeys(self.totals, 0)
        self.spans: list[tuple[str, float, float]] = []

    def begin(self, version: int) -> None:
        self._reset()
        self.version = version

    def dispatched(self, seconds: float) -> None:
        now = time.monotonic()
        self.step["dispatches"] += 1
        self.step["dispatch_seconds"] += seconds
        self.spans.append(("experts.dispatch", now - seconds, now))

    def tokens(self, remote: int, local: int) -> None:
        self.step["remote_pairs"] += remote
        self.step["local_pairs"] += local

    def combined(self, waited: float, round_trip: float, ready: bool) -> None:
        now = time.monotonic()
        self.step["combines"] += 1
        self.step["combines_ready"] += int(ready)
        self.step["wait_seconds"] += waited
        self.step["round_trip_seconds"] += round_trip
        self.spans.append(("experts.combine", now - waited, now))

    def fell_back(self) -> None:
        self.step["fallbacks"] += 1

    def end(self) -> None:
        step = self.step
        if not step["dispatches"]:
            return
        step["steps"] = 1
        with self._lock:
            for key, value in step.items():
                self.totals[key] += value
        labels = {"worker": self.worker_id}
        metrics.TOKENS_DISPATCHED.labels(where="remote", **labels).inc(step["remote_pairs"])
        metrics.TOKENS_DISPATCHED.labels(where="local", **labels).inc(step["local_pairs"])
        metrics.DISPATCH_SECONDS.labels(**labels).observe(step["dispatch_seconds"])
        metrics.COMBINE_WAIT_SECONDS.labels(**labels).observe(step["wait_seconds"])
        if step["round_trip_seconds"] > 0:
            metrics.OVERLAP_RATIO.labels(**labels).set(self.overlap(step))
        self._span()

    @staticmethod
    def overlap(counts: dict) -> float:
        """Share of the expert round trips spent on other work, not waiting."""
        trips = counts["round_trip_seconds"]
        return max(0.0, 1.0 - counts["wait_seconds"] / trips) if trips > 0 else 0.0

    def snapshot(self) -> dict:
        with self._lock:
            out = dict(self.totals)
        out["overlap"] = self.overlap(out)
        return out

    def _span(self) -> None:
        if self.tracer is None:
            return
        step = self.step
        span = self.tracer.start_span(
            "experts.step",
            start_time=epoch_ns(self.started),
            attributes={
                "yinian.placement_version": self.version,
                "yinian.expert_pairs_remote": step["remote_pairs"],
                "yinian.expert_pairs_local": step["local_pairs"],
                "yinian.expert_overlap": self.overlap(step),
                "yinian.expert_fallbacks": step["fallbacks"],
            },
        )
        context = trace.set_span_in_context(span)
        for name, start, end in self.spans:
            self.tracer.start_span(name, context=context, start_time=epoch_ns(start)).end(
                end_time=epoch_ns(end)
            )
        span.end()
