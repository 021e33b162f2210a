"""Prometheus metrics of expert parallelism: the workers' dispatch and combine,
the expert services' work, and the balancer's view of the balance."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.common.metrics import EXPERT, SCHEDULER, WORKER

_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)

# Workers
TOKENS_DISPATCHED = Counter(
    "yinian:expert_tokens_dispatched",
    "(token, expert) pairs sent to expert services, by where they were computed",
    ["worker", "where"],  # where: remote or local
    registry=WORKER,
)
DISPATCH_SECONDS = Histogram(
    "yinian:expert_dispatch_seconds",
    "Time per step spent issuing dispatches (routing, packing, queueing the all-to-alls)",
    ["worker"],
    buckets=_STEP_BUCKETS,
    registry=WORKER,
)
COMBINE_WAIT_SECONDS = Histogram(
    "yinian:expert_combine_wait_seconds",
    "Time per step a combine waited for expert results (what overlap did not hide)",
    ["worker"],
    buckets=_STEP_BUCKETS,
    registry=WORKER,
)
OVERLAP_RATIO = Gauge(
    "yinian:expert_overlap_ratio",
    "Share of the expert round trips of the last step hidden behind other work",
    ["worker"],
    registry=WORKER,
)
FALLBACKS = Counter(
    "yinian:expert_fallbacks",
    "Dispatches computed locally because the expert group failed",
    ["worker"],
    registry=WORKER,
)
PLACEMENT_VERSION = Gauge(
    "yinian:expert_placement_version",
    "The placement a worker routes by",
    ["worker"],
    registry=WORKER,
)

# Expert services
SERVICE_TOKENS = Counter(
    "yinian:expert_service_tokens",
    "Rows an expert service computed",
    ["expert_id"],
    registry=EXPERT,
)
SERVICE_COMPUTE_SECONDS = Histogram(
    "yinian:expert_service_compute_seconds",
    "Time an expert service spent on one dispatch",
    ["expert_id"],
    buckets=_STEP_BUCKETS,
    registry=EXPERT,
)
SERVICE_HELD = Gauge(
    "yinian:expert_service_held_experts",
    "(layer, expert) pairs held",
    ["expert_id"],
    registry=EXPERT,
)

# Balancer
LAYER_IMBALANCE = Gauge(
    "yinian:expert_layer_imbalance",
    "max / mean tokens per expert service, per MoE layer, since the placement was applied",
    ["layer"],
    registry=SCHEDULER,
)
REBALANCES = Counter(
    "yinian:expert_rebalances", "Placements applied, by cause", ["cause"], registry=SCHEDULER
)
