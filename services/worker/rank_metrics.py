"""A parallel worker's ranks as Prometheus gauges: per rank, the seconds it spent
computing steps and in collectives, and the steps it ran. Under load, a stage's
busy-seconds rate is its utilisation and 1 minus it the pipeline bubble."""

from __future__ import annotations

import asyncio

from engine import AsyncLLM
from services.common import metrics


async def report_ranks(engine: AsyncLLM, worker_id: str, interval: float = 2.0) -> None:
    facts = engine.facts
    if facts.tensor_parallel_size * facts.pipeline_parallel_size == 1:
        return
    while True:
        for row in await engine.parallel_stats():
            labels = {"worker": worker_id, "rank": str(row["rank"]), "stage": str(row["stage"])}
            metrics.RANK_BUSY_SECONDS.labels(**labels).set(row["busy_seconds"])
            metrics.RANK_COLLECTIVE_SECONDS.labels(**labels).set(row["collective_seconds"])
            metrics.RANK_STEPS.labels(**labels).set(row["steps"])
        await asyncio.sleep(interval)
