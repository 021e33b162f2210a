"""The worker's settings, from flags or YINIAN_* environment variables."""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from dataclasses import dataclass, field

from engine.cli_args import add_engine_args, engine_options

ROLES = ("colocated", "prefill", "decode")


@dataclass(slots=True)
class WorkerConfig:
    model: str
    role: str = "colocated"
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    advertise_host: str | None = None  # what the scheduler gives out, if not `host`
    worker_id: str = ""
    scheduler: str = "127.0.0.1:50052"
    nats_url: str = "nats://127.0.0.1:4222"
    metrics_port: int = 0
    load_interval: float = 0.5
    # KV handoff: transports this worker speaks (None: tcp, plus cuda_ipc on CUDA),
    # how long a prefill worker holds blocks for us, how long a handoff may take.
    kv_transports: list[str] | None = None
    kv_lease_seconds: float = 30.0
    prefill_timeout: float = 120.0
    engine_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.worker_id:
            self.worker_id = f"{self.role}-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


def parse(argv: list[str] | None = None, role: str = "colocated") -> WorkerConfig:
    env = os.environ.get
    parser = argparse.ArgumentParser(description="yinian worker")
    parser.add_argument(
        "--model", default=env("YINIAN_MODEL"), required=env("YINIAN_MODEL") is None
    )
    parser.add_argument("--role", default=env("YINIAN_ROLE", role), choices=ROLES)
    parser.add_argument("--host", default=env("YINIAN_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(env("YINIAN_PORT", "0")))
    parser.add_argument("--advertise-host", default=env("YINIAN_ADVERTISE_HOST"))
    parser.add_argument("--worker-id", default=env("YINIAN_WORKER_ID", ""))
    parser.add_argument("--scheduler", default=env("YINIAN_SCHEDULER", "127.0.0.1:50052"))
    parser.add_argument("--nats-url", default=env("YINIAN_NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument("--metrics-port", type=int, default=int(env("YINIAN_METRICS_PORT", "0")))
    parser.add_argument("--load-interval", type=float, default=0.5)
    parser.add_argument(
        "--kv-transports",
        default=env("YINIAN_KV_TRANSPORTS"),
        help="comma-separated: tcp, cuda_ipc, nccl (default: tcp, plus cuda_ipc on CUDA)",
    )
    parser.add_argument(
        "--kv-lease-seconds",
        type=float,
        default=30.0,
        help="how long a prefill worker keeps handed-off blocks for us",
    )
    parser.add_argument("--prefill-timeout", type=float, default=120.0)
    add_engine_args(parser)
    args = parser.parse_args(argv)
    return WorkerConfig(
        model=args.model,
        role=args.role,
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        worker_id=args.worker_id,
        scheduler=args.scheduler,
        nats_url=args.nats_url,
        metrics_port=args.metrics_port,
        load_interval=args.load_interval,
        kv_transports=args.kv_transports.split(",") if args.kv_transports else None,
        kv_lease_seconds=args.kv_lease_seconds,
        prefill_timeout=args.prefill_timeout,
        engine_options=engine_options(args),
    )
