"""The scheduler's settings, from flags or YINIAN_* environment variables."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerConfig:
    host: str = "127.0.0.1"
    port: int = 50052
    nats_url: str = "nats://127.0.0.1:4222"
    heartbeat_timeout: float = 2.0
    max_waiting: int | None = None
    metrics_port: int = 0
    disagg_min_tokens: int = 512

    def __post_init__(self) -> None:
        if self.heartbeat_timeout <= 0:
            raise ValueError("heartbeat_timeout must be > 0")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")


def parse(argv: list[str] | None = None) -> SchedulerConfig:
    env = os.environ.get
    parser = argparse.ArgumentParser(description="yinian PD scheduler")
    parser.add_argument("--host", default=env("YINIAN_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(env("YINIAN_SCHEDULER_PORT", "50052")))
    parser.add_argument("--nats-url", default=env("YINIAN_NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=2.0,
        help="seconds without a load report before a worker is dropped",
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="requests a worker may queue beyond max_num_seqs before it counts "
        "as saturated (default: max_num_seqs)",
    )
    parser.add_argument("--metrics-port", type=int, default=int(env("YINIAN_METRICS_PORT", "0")))
    parser.add_argument(
        "--disagg-min-tokens",
        type=int,
        default=512,
        help="prompts whose uncached part is shorter are prefilled by their "
        "decode worker instead of a prefill worker",
    )
    a = parser.parse_args(argv)
    return SchedulerConfig(
        a.host,
        a.port,
        a.nats_url,
        a.heartbeat_timeout,
        a.max_waiting,
        a.metrics_port,
        a.disagg_min_tokens,
    )
