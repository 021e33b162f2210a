"""Prometheus metrics, named like vLLM's with a `yinian:` prefix. Each service
exposes only the ones it owns; `serve_metrics` starts the scrape endpoint of
a service without a web server of its own."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)

# Engine-side (workers)
NUM_REQUESTS_RUNNING = Gauge(
    "yinian:num_requests_running", "Requests in the engine's running batch", ["worker"]
)
NUM_REQUESTS_WAITING = Gauge(
    "yinian:num_requests_waiting", "Requests waiting for the engine", ["worker"]
)
KV_CACHE_USAGE = Gauge("yinian:kv_cache_usage_ratio", "Fraction of KV blocks in use", ["worker"])
PREFIX_CACHE_HIT = Gauge(
    "yinian:prefix_cache_hit_ratio",
    "Prompt tokens served from the prefix cache / prompt tokens",
    ["worker"],
)
WORKER_REQUESTS = Counter("yinian:worker_requests", "Requests a worker has taken", ["worker"])
NUM_PREEMPTIONS = Gauge("yinian:num_preemptions", "Preemptions so far", ["worker"])

# KV handoffs (decode workers)
KV_TRANSFER_BLOCKS = Counter(
    "yinian:kv_transfer_blocks", "KV blocks received from prefill workers", ["worker", "transport"]
)
KV_TRANSFER_BYTES = Counter(
    "yinian:kv_transfer_bytes", "KV bytes received from prefill workers", ["worker", "transport"]
)
KV_SKIPPED_BLOCKS = Counter(
    "yinian:kv_skipped_blocks",
    "Prompt blocks not transferred: already in this worker's prefix cache",
    ["worker"],
)
KV_TRANSFER_SECONDS = Histogram(
    "yinian:kv_transfer_seconds",
    "Time from the prefill's end to the KV in place",
    buckets=_LATENCY_BUCKETS,
)
KV_HANDOFF_FALLBACKS = Counter(
    "yinian:kv_handoff_fallbacks", "Handoffs that failed and were prefilled locally", ["worker"]
)

# Request-side (gateway)
TTFT = Histogram(
    "yinian:time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS
)
ITL = Histogram(
    "yinian:inter_token_latency_seconds", "Time between streamed tokens", buckets=_LATENCY_BUCKETS
)
E2E = Histogram(
    "yinian:e2e_request_latency_seconds", "Request latency end to end", buckets=_LATENCY_BUCKETS
)
REQUESTS = Counter("yinian:request_total", "Finished requests", ["finish_reason"])
PROMPT_TOKENS = Counter("yinian:prompt_tokens_total", "Prompt tokens")
GENERATION_TOKENS = Counter("yinian:generation_tokens_total", "Generated tokens")
GATEWAY_IN_FLIGHT = Gauge("yinian:gateway_requests_in_flight", "Requests the gateway is serving")
MIGRATIONS = Counter(
    "yinian:request_migrations", "Streams moved to another worker after theirs failed"
)

# Scheduler
PLACEMENTS = Counter("yinian:placements_total", "Placement decisions", ["outcome"])
READY_WORKERS = Gauge("yinian:ready_workers", "Workers ready for placement", ["role"])


def serve_metrics(port: int, host: str = "127.0.0.1") -> int:
    """Starts /metrics on `port` (0: any free port); returns the port."""
    server, _thread = start_http_server(port, addr=host)
    return server.server_port
