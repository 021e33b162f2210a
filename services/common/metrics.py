"""Prometheus metrics, named like vLLM's with a `yinian:` prefix. Each service
exposes only the ones it owns: every metric lives in its owner's registry
(WORKER, GATEWAY, SCHEDULER, KVSTORE, EXPERT), which also carries the process's
own (process_*, python_*). `serve_metrics` starts the scrape endpoint of a
service without a web server of its own."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


WORKER, GATEWAY, SCHEDULER, KVSTORE, EXPERT = (_registry() for _ in range(5))

STARTUP_SECONDS = Gauge(
    "yinian:startup_seconds",
    "How long the worker's engine took to start, by phase (config, ranks, weights, kv cache, "
    "warm-up, graphs, host tier or engine)",
    ["worker", "phase"],
    registry=WORKER,
)

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
    "yinian:num_requests_running",
    "Requests in the engine's running batch",
    ["worker"],
    registry=WORKER,
)
NUM_REQUESTS_WAITING = Gauge(
    "yinian:num_requests_waiting", "Requests waiting for the engine", ["worker"], registry=WORKER
)
KV_CACHE_USAGE = Gauge(
    "yinian:kv_cache_usage_ratio", "Fraction of KV blocks in use", ["worker"], registry=WORKER
)
PREFIX_CACHE_HIT = Gauge(
    "yinian:prefix_cache_hit_ratio",
    "Prompt tokens served from the prefix cache / prompt tokens",
    ["worker"],
    registry=WORKER,
)
PREFIX_HIT_TOKENS = Gauge(
    "yinian:prefix_cache_hit_tokens",
    "Prompt tokens served from cache so far, by the tier they came from",
    ["worker", "tier"],
    registry=WORKER,
)
PREFIX_QUERIED_TOKENS = Gauge(
    "yinian:prefix_cache_queried_tokens",
    "Prompt tokens looked up in the cache so far",
    ["worker"],
    registry=WORKER,
)
KV_FRAGMENTATION = Gauge(
    "yinian:kv_fragmentation_ratio",
    "Allocated but unused token slots over allocated slots, in the device KV cache",
    ["worker"],
    registry=WORKER,
)
HOST_KV_BYTES = Gauge(
    "yinian:host_kv_bytes",
    "Bytes moved between device and host tier so far",
    ["worker", "direction"],
    registry=WORKER,
)
HOST_KV_BLOCKS = Gauge(
    "yinian:host_kv_blocks",
    "The host tier's blocks: cached now; evicted for newer ones so far; stores refused so "
    "far, every slot being pinned by a copy",
    ["worker", "kind"],
    registry=WORKER,
)
ENGINE_STEPS = Gauge(
    "yinian:engine_steps",
    "Steps the engine has run: all of them; those whose device time was measured",
    ["worker", "kind"],
    registry=WORKER,
)
ENGINE_STEP_SECONDS = Gauge(
    "yinian:engine_step_seconds",
    "Seconds so far the engine thread waited for its steps on the device (wait); the "
    "device's own time of the steps measured (device)",
    ["worker", "kind"],
    registry=WORKER,
)
ENGINE_THREAD_SECONDS = Gauge(
    "yinian:engine_thread_seconds",
    "Seconds so far the engine thread spent, by what it did (step, calls, requests, "
    "housekeeping, publish, idle)",
    ["worker", "part"],
    registry=WORKER,
)
SPEC_TOKENS = Gauge(
    "yinian:spec_decode_tokens",
    "Speculative decoding so far: draft tokens verified (kind=draft) and kept (kind=accepted)",
    ["worker", "kind"],
    registry=WORKER,
)
SPEC_ACCEPTED_BY_POSITION = Gauge(
    "yinian:spec_decode_acceptance",
    "Speculative decoding: the share of drafts kept at each position of a step's drafts",
    ["worker", "position"],
    registry=WORKER,
)
# Tensor/pipeline parallel workers, per rank
RANK_BUSY_SECONDS = Gauge(
    "yinian:rank_busy_seconds",
    "Seconds a rank spent computing steps",
    ["worker", "rank", "stage"],
    registry=WORKER,
)
RANK_COLLECTIVE_SECONDS = Gauge(
    "yinian:rank_collective_seconds",
    "Seconds a rank spent in collectives (all-reduce, gather)",
    ["worker", "rank", "stage"],
    registry=WORKER,
)
RANK_STEPS = Gauge(
    "yinian:rank_steps", "Steps a rank ran", ["worker", "rank", "stage"], registry=WORKER
)
WORKER_REQUESTS = Counter(
    "yinian:worker_requests", "Requests a worker has taken", ["worker"], registry=WORKER
)
NUM_PREEMPTIONS = Gauge("yinian:num_preemptions", "Preemptions so far", ["worker"], registry=WORKER)

# KV handoffs (decode workers)
KV_TRANSFER_BLOCKS = Counter(
    "yinian:kv_transfer_blocks",
    "KV blocks received from prefill workers",
    ["worker", "transport"],
    registry=WORKER,
)
KV_TRANSFER_BYTES = Counter(
    "yinian:kv_transfer_bytes",
    "KV bytes received from prefill workers",
    ["worker", "transport"],
    registry=WORKER,
)
KV_SKIPPED_BLOCKS = Counter(
    "yinian:kv_skipped_blocks",
    "Prompt blocks not transferred: already in this worker's prefix cache",
    ["worker"],
    registry=WORKER,
)
KV_TRANSFER_SECONDS = Histogram(
    "yinian:kv_transfer_seconds",
    "Time from the prefill's end to the KV in place",
    buckets=_LATENCY_BUCKETS,
    registry=WORKER,
)
KV_HANDOFF_FALLBACKS = Counter(
    "yinian:kv_handoff_fallbacks",
    "Handoffs that failed and were prefilled locally",
    ["worker"],
    registry=WORKER,
)

# The shared KV tier as workers use it
KV_SHARED_FETCHED_TOKENS = Counter(
    "yinian:kv_shared_fetched_tokens",
    "Prompt tokens fetched from the shared tier: lent (copied from the KV store's memory "
    "straight to the device) or copied (into the host tier)",
    ["worker", "path"],
    registry=WORKER,
)
KV_SHARED_PREFETCHES = Counter(
    "yinian:kv_shared_prefetches",
    "Prompts checked against the shared tier before they run, by outcome: not_indexed "
    "(its events say it holds none of the prompt's blocks), local (this worker holds "
    "all it holds), filled (blocks came), missed (asked, none came: not there any more, "
    "no room, or the copy was late)",
    ["worker", "outcome"],
    registry=WORKER,
)
KV_STORE_MEMORY_MAPPED = Gauge(
    "yinian:kv_store_memory_mapped",
    "1 once the KV store's memory tier is mapped (and pinned) here: its blocks are lent "
    "straight to the device",
    ["worker"],
    registry=WORKER,
)
KV_SHARED_BYTES = Counter(
    "yinian:kv_shared_bytes",
    "KV bytes moved to and from the shared tier",
    ["worker", "direction"],
    registry=WORKER,
)
KV_SHARED_FETCH_SECONDS = Histogram(
    "yinian:kv_shared_fetch_seconds",
    "Lookup and fetch of a prompt's blocks from the shared tier",
    buckets=_LATENCY_BUCKETS,
    registry=WORKER,
)
KV_SHARED_REJECTED = Counter(
    "yinian:kv_shared_rejected_blocks",
    "Shared-tier blocks that failed a worker's check and were recomputed",
    ["worker"],
    registry=WORKER,
)
KV_SHARED_WRITTEN_BLOCKS = Counter(
    "yinian:kv_shared_written_blocks",
    "Blocks written through to the shared tier",
    ["worker"],
    registry=WORKER,
)
KV_SHARED_DROPPED_BLOCKS = Counter(
    "yinian:kv_shared_dropped_blocks",
    "Blocks the write policy chose that were not written: the write queue was full "
    "(queue_full), the block had left the host tier (not_local), or the store refused "
    "or failed (store)",
    ["worker", "reason"],
    registry=WORKER,
)
KV_SHARED_PENDING_BYTES = Gauge(
    "yinian:kv_shared_pending_bytes",
    "Bytes of blocks queued or in flight to the shared tier (at most the write queue's bound)",
    ["worker"],
    registry=WORKER,
)

# Request-side (gateway)
TTFT = Histogram(
    "yinian:time_to_first_token_seconds",
    "Time to first token",
    buckets=_LATENCY_BUCKETS,
    registry=GATEWAY,
)
ITL = Histogram(
    "yinian:inter_token_latency_seconds",
    "Time between streamed tokens",
    buckets=_LATENCY_BUCKETS,
    registry=GATEWAY,
)
E2E = Histogram(
    "yinian:e2e_request_latency_seconds",
    "Request latency end to end",
    buckets=_LATENCY_BUCKETS,
    registry=GATEWAY,
)
REQUESTS = Counter("yinian:request_total", "Finished requests", ["finish_reason"], registry=GATEWAY)
PROMPT_TOKENS = Counter("yinian:prompt_tokens_total", "Prompt tokens", registry=GATEWAY)
GENERATION_TOKENS = Counter("yinian:generation_tokens_total", "Generated tokens", registry=GATEWAY)
GATEWAY_IN_FLIGHT = Gauge(
    "yinian:gateway_requests_in_flight", "Requests the gateway is serving", registry=GATEWAY
)
RATE_LIMITED = Counter(
    "yinian:rate_limited",
    "Requests refused by a tenant's limits (429)",
    ["reason"],
    registry=GATEWAY,
)
MIGRATIONS = Counter(
    "yinian:request_migrations",
    "Streams moved to another worker after theirs failed",
    registry=GATEWAY,
)


# Placement: the scheduler's, and a gateway's that places requests itself
def _placement_metrics(registry: CollectorRegistry) -> tuple[Counter, Counter, Counter]:
    placements = Counter(
        "yinian:placements_total", "Placement decisions", ["outcome"], registry=registry
    )
    prefix_blocks = Counter(
        "yinian:placed_prefix_blocks",
        "Prompt blocks the KV index says are cached (any tier) at the worker each placement "
        "chose (chosen), and at the open worker holding the most (longest): the gap is cache "
        "given up for load",
        ["kind"],
        registry=registry,
    )
    gaps = Counter(
        "yinian:kv_index_gaps",
        "KV event batches found missing (the holder's entries are dropped until it resyncs)",
        ["holder"],
        registry=registry,
    )
    return placements, prefix_blocks, gaps


PLACEMENTS, PLACED_PREFIX_BLOCKS, KV_INDEX_GAPS = _placement_metrics(SCHEDULER)
GATEWAY_PLACEMENTS, GATEWAY_PLACED_PREFIX_BLOCKS, GATEWAY_KV_INDEX_GAPS = _placement_metrics(
    GATEWAY
)


class IndexBlocks:
    """`yinian:kv_index_blocks` of a KV index, read when scraped: a gateway that places
    requests itself sets `index` to its own (until then nothing is exported)."""

    NAME = "yinian:kv_index_blocks"
    HELP = ("Blocks the gateway's KV index knows, by holder (a worker, or the shared tier) "
            "and tier")  # fmt: skip

    def __init__(self, registry: CollectorRegistry):
        self.index = None
        registry.register(self)

    def describe(self):
        yield GaugeMetricFamily(self.NAME, self.HELP, labels=["holder", "tier"])

    def collect(self):
        if self.index is None:
            return
        family = GaugeMetricFamily(self.NAME, self.HELP, labels=["holder", "tier"])
        for (holder, tier), count in self.index.sizes().items():
            family.add_metric([holder, tier], count)
        yield family


GATEWAY_KV_INDEX_BLOCKS = IndexBlocks(GATEWAY)

# Scheduler
KV_INDEX_BLOCKS = Gauge(
    "yinian:kv_index_blocks",
    "Blocks the scheduler's KV index knows, by holder (a worker, or the shared tier) and tier",
    ["holder", "tier"],
    registry=SCHEDULER,
)
READY_WORKERS = Gauge(
    "yinian:ready_workers", "Workers ready for placement", ["role"], registry=SCHEDULER
)

# KV store (services/kvstore): the shared tier
_REDIS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
KVSTORE_LOOKUP_BLOCKS = Counter(
    "yinian:kvstore_lookup_blocks",
    "Blocks Lookup asked of the shared tier: hit (in its prefix) or miss",
    ["tenant", "result"],
    registry=KVSTORE,
)
KVSTORE_GET_BLOCKS = Counter(
    "yinian:kvstore_get_blocks",
    "Blocks Get was asked for: hit (served) or miss (missing or failed verification)",
    ["tenant", "result"],
    registry=KVSTORE,
)
KVSTORE_BYTES = Counter(
    "yinian:kvstore_bytes",
    "Block bytes into (put) and out of (get) the shared tier",
    ["direction"],
    registry=KVSTORE,
)
KVSTORE_EVICTIONS = Counter(
    "yinian:kvstore_evictions",
    "Blocks evicted from the shared tier",
    ["tenant", "reason"],
    registry=KVSTORE,
)
KVSTORE_VERIFICATION_FAILURES = Counter(
    "yinian:kvstore_verification_failures",
    "Stored blocks that failed verification when read (dropped, never returned)",
    ["tenant", "reason"],
    registry=KVSTORE,
)
KVSTORE_REJECTED_PUTS = Counter(
    "yinian:kvstore_rejected_puts",
    "Blocks Put did not store",
    ["tenant", "reason"],
    registry=KVSTORE,
)
KVSTORE_TENANT_BYTES = Gauge(
    "yinian:kvstore_tenant_bytes",
    "Bytes a tenant holds in the shared tier",
    ["tenant"],
    registry=KVSTORE,
)
KVSTORE_TENANT_QUOTA = Gauge(
    "yinian:kvstore_tenant_quota_bytes",
    "A tenant's quota in the shared tier",
    ["tenant"],
    registry=KVSTORE,
)
KVSTORE_REDIS_SECONDS = Histogram(
    "yinian:kvstore_redis_seconds",
    "Shared-tier round trips to Redis",
    ["op"],
    buckets=_REDIS_BUCKETS,
    registry=KVSTORE,
)
KVSTORE_REDIS_ERRORS = Counter(
    "yinian:kvstore_redis_errors",
    "Shared-tier calls failed: Redis down, unreachable or slow",
    ["op"],
    registry=KVSTORE,
)
KVSTORE_MEMORY_BLOCKS = Gauge(
    "yinian:kvstore_memory_blocks",
    "Blocks in the KV store's memory tier (in front of Redis)",
    registry=KVSTORE,
)
KVSTORE_SPILLED_BLOCKS = Counter(
    "yinian:kvstore_spilled_blocks",
    "Blocks the memory tier evicted, by what became of them: stored in Redis, rejected by it, "
    "or dropped (the spill queue was full)",
    ["outcome"],
    registry=KVSTORE,
)


def serve_metrics(port: int, host: str, registry: CollectorRegistry) -> int:
    """Starts /metrics of `registry` on `port` (0: any free port); returns the port."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server.server_port
