"""The scheduler's settings; each field is a flag (and a YINIAN_* variable)."""

from __future__ import annotations

from dataclasses import dataclass

from basis.flags import parse_config, setting
from services.common.tls import TlsSettings


@dataclass(slots=True)
class SchedulerConfig(TlsSettings):
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(50052, "gRPC port", env="YINIAN_SCHEDULER_PORT")
    nats_url: str = setting("nats://127.0.0.1:4222", "NATS for load reports and KV events")
    heartbeat_timeout: float = setting(
        2.0, "seconds without a load report before a worker is dropped"
    )
    max_waiting: int | None = setting(
        None,
        "requests a worker may queue beyond max_num_seqs before it counts as saturated "
        "(default: max_num_seqs)",
    )
    metrics_port: int = setting(0, "Prometheus /metrics port (0: any free port)")
    disagg_min_tokens: int = setting(
        512,
        "prompts whose uncached part is shorter are prefilled by their decode worker "
        "instead of a prefill worker",
    )

    host_hit_weight: float = setting(
        0.1, "cost of a prompt token found in a worker's host tier, as a fraction of computing it"
    )
    shared_hit_weight: float = setting(
        0.3, "cost of a prompt token found in the shared tier, as a fraction of computing it"
    )
    placement_request_tokens: float = setting(
        64.0,
        "prompt tokens to compute that weigh as much as one more request running or queued "
        "on a worker, when placement weighs a cached prefix against load",
    )
    placement_memory_tokens: float = setting(
        2048.0,
        "prompt tokens that weigh as much as a worker's device KV pool fully in use",
    )
    # The expert balancer (services/scheduler/expert_*.py).
    expert_balancer: bool = setting(
        True,
        "serve the expert balancer that MoE expert services register with (off: expert "
        "services are refused, and the scheduler starts without loading torch)",
    )
    expert_redundant_slots: int = setting(
        0, "expert slots per MoE layer beyond one per expert, for EPLB's replicas of hot experts"
    )
    eplb_interval: float = setting(
        0.0, "seconds between EPLB rebalances while serving (0: only on a Rebalance call)"
    )
    eplb_window: float = setting(
        10.0, "expert services count load in the last this many seconds before a rebalance"
    )
    eplb_groups: int = setting(
        1, "expert groups for hierarchical EPLB (it is used when they divide over the hosts)"
    )

    def __post_init__(self) -> None:
        if self.heartbeat_timeout <= 0:
            raise ValueError("heartbeat_timeout must be > 0")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        for name in ("host_hit_weight", "shared_hit_weight"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1]")
        if self.placement_request_tokens < 0 or self.placement_memory_tokens < 0:
            raise ValueError("placement_request_tokens and placement_memory_tokens must be >= 0")
        if self.disagg_min_tokens < 0:
            raise ValueError("disagg_min_tokens must be >= 0")
        if self.expert_redundant_slots < 0 or self.eplb_interval < 0 or self.eplb_window <= 0:
            raise ValueError(
                "need expert_redundant_slots >= 0, eplb_interval >= 0, eplb_window > 0"
            )
        if self.eplb_groups < 1:
            raise ValueError("eplb_groups must be >= 1")
        TlsSettings.__post_init__(self)


def parse(argv: list[str] | None = None) -> SchedulerConfig:
    return parse_config(SchedulerConfig, argv, "yinian PD scheduler")
