"""An expert service's settings; each field is a flag (and a YINIAN_* variable)."""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass

from basis.flags import parse_config, setting
from services.common.tls import TlsSettings

_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(slots=True)
class ExpertConfig(TlsSettings):
    model: str = setting(help="model folder (a Hugging Face checkpoint with MoE layers)")
    slots: int = setting(
        8,
        "expert slots per MoE layer this service offers (the balancer fills them)",
        env="YINIAN_EXPERT_SLOTS",
    )
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(0, "gRPC port (0: any free port)", env="YINIAN_EXPERT_PORT")
    advertise_host: str | None = setting(
        None, "address workers reach this service at (default: --host)"
    )
    expert_id: str = setting("", "name in the balancer's membership (default: expert-host-random)")
    scheduler: str = setting(
        "127.0.0.1:50052", "the scheduler's gRPC address (its expert balancer)"
    )
    nats_url: str = setting("nats://127.0.0.1:4222", "NATS for expert load reports")
    metrics_port: int = setting(0, "Prometheus /metrics port (0: any free port)")
    report_interval: float = setting(0.5, "seconds between expert load reports (heartbeats)")
    dtype: str = setting(
        "auto",
        "weights and activations: auto (the checkpoint's), float32, bfloat16 or float16; "
        "workers must use the same",
        env="YINIAN_EXPERT_DTYPE",
        choices=_DTYPES,
    )
    device: str = setting("cpu", "cpu, cuda or cuda:N", env="YINIAN_EXPERT_DEVICE")
    load_format: str = setting(
        "auto",
        "auto (the checkpoint's experts), or dummy (seeded random experts: benchmarks of "
        "models without weights; outputs differ from the workers' own)",
        env="YINIAN_EXPERT_LOAD_FORMAT",
        choices=("auto", "dummy"),
    )
    threads: int = setting(
        1,
        "torch intra-op threads for CPU compute (more only on cores nothing else uses: "
        "threads that spin for a busy core slow every dispatch down)",
        env="YINIAN_EXPERT_THREADS",
    )

    def __post_init__(self) -> None:
        TlsSettings.__post_init__(self)
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if not 0 <= self.port < 65536 or not 0 <= self.metrics_port < 65536:
            raise ValueError("ports must be in 0..65535")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.report_interval <= 0:
            raise ValueError("report_interval must be > 0")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}")
        if not self.expert_id:
            self.expert_id = f"expert-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"

    @property
    def address_host(self) -> str:
        return self.advertise_host or self.host


def parse(argv: list[str] | None = None) -> ExpertConfig:
    return parse_config(ExpertConfig, argv, "yinian MoE expert service")
