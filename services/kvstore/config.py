"""The KV store's settings; each field is a flag (and a YINIAN_* variable)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from basis.flags import parse_config, setting
from services.common.tls import TlsSettings

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass(slots=True)
class KvStoreConfig(TlsSettings):
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(50053, "gRPC port", env="YINIAN_KVSTORE_PORT")
    redis_url: str = setting(
        "",
        "Redis of the shared tier, e.g. redis://127.0.0.1:6379/0 (empty: no Redis; without "
        "--memory-tier-bytes either, no shared tier)",
    )
    redis_cluster: bool = setting(False, "--redis-url names a node of a Redis Cluster")
    block_key_file: str = setting(
        "",
        "file of the mesh's block key (64 hex digits) that tags blocks in Redis; every store "
        "of a mesh needs the same (default: YINIAN_BLOCK_KEY, else a random one)",
    )
    redis_timeout: float = setting(
        0.5, "seconds a Redis call may take before it counts as failed (a miss, never a hang)"
    )
    nats_url: str = setting("nats://127.0.0.1:4222", "NATS for KV events and resync requests")
    metrics_port: int = setting(0, "Prometheus /metrics port (0: any free port)")
    capacity_bytes: int = setting(
        1 << 30, "the shared tier's total; beyond it the least recently used blocks are evicted"
    )
    memory_tier_bytes: int = setting(
        0,
        "bytes of the store's own memory tier in front of Redis: blocks of one size in the "
        "store's memory (a shared-memory file where there is room), copied to and from workers' "
        "host tiers on this host by threads or lent to their GPUs; what it evicts spills into "
        "Redis (0: off)",
    )
    memory_spill_queue_bytes: int = setting(
        256 << 20, "bytes of evicted blocks waiting for Redis; beyond it they are dropped"
    )
    copy_threads: int = setting(8, "threads that copy blocks into and out of the memory tier")
    tenant_quota_bytes: int = setting(
        0, "bytes each tenant may keep in the shared tier (0: up to the capacity)"
    )
    tenant_quotas: str = setting(
        "", "file of per-tenant quotas, 'tenant bytes' per line, overriding --tenant-quota-bytes"
    )
    lease_seconds: float = setting(
        10.0, "a Lookup or Get keeps the blocks it reports from eviction this long"
    )
    max_lease_seconds: float = setting(
        30.0, "repeated lookups never keep a block leased longer than this after its first lease"
    )
    pending_put_seconds: float = setting(
        30.0, "a put not finished this long after it started is dropped"
    )
    public_tenant: str = setting("__public__", "the namespace every tenant may read")
    max_block_bytes: int = setting(64 << 20, "the largest block a Put accepts")

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536 or not 0 <= self.metrics_port < 65536:
            raise ValueError("ports must be in 0..65535")
        if self.redis_url and not self.redis_url.startswith(_REDIS_SCHEMES):
            raise ValueError(f"--redis-url must start with one of {', '.join(_REDIS_SCHEMES)}")
        if self.redis_cluster and not self.redis_url:
            raise ValueError("--redis-cluster needs --redis-url")
        if self.redis_timeout <= 0:
            raise ValueError("redis_timeout must be > 0")
        if self.capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be > 0")
        if self.memory_tier_bytes < 0 or self.memory_spill_queue_bytes < 0:
            raise ValueError("memory_tier_bytes and memory_spill_queue_bytes must be >= 0")
        if self.copy_threads < 1:
            raise ValueError("copy_threads must be >= 1")
        if self.tenant_quota_bytes < 0:
            raise ValueError("tenant_quota_bytes must be >= 0")
        if self.tenant_quotas and not os.path.isfile(self.tenant_quotas):
            raise ValueError(f"--tenant-quotas: no file {self.tenant_quotas}")
        if self.lease_seconds <= 0 or self.max_lease_seconds < self.lease_seconds:
            raise ValueError("need 0 < lease_seconds <= max_lease_seconds")
        if self.pending_put_seconds <= 0:
            raise ValueError("pending_put_seconds must be > 0")
        if not self.public_tenant:
            raise ValueError("public_tenant must not be empty (that is the default tenant)")
        if self.max_block_bytes <= 0:
            raise ValueError("max_block_bytes must be > 0")
        TlsSettings.__post_init__(self)


def parse(argv: list[str] | None = None) -> KvStoreConfig:
    return parse_config(KvStoreConfig, argv, "yinian KV block store")
