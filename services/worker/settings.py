"""The settings every engine worker (prefill and decode services) shares: where
it listens, how it is named and found, where it reports, the KV transports it
speaks, and the engine options (the engine's own flags, `engine/cli_args.py`)."""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass

from basis.flags import not_a_flag, parse_config, setting
from engine.cli_args import add_engine_args, engine_options
from services.common.tls import TlsSettings
from services.expert_parallel import FALLBACKS, TRANSPORTS

KV_TRANSPORTS = ("tcp", "cuda_ipc", "nccl")
WRITE_THROUGH = ("none", "selective", "prefix", "all")


@dataclass(slots=True)
class WorkerSettings(TlsSettings):
    model: str = setting(help="model folder (a Hugging Face checkpoint)")
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(0, "gRPC port (0: any free port)")
    advertise_host: str | None = setting(
        None, "address the scheduler gives out for this worker (default: --host)"
    )
    worker_id: str = setting("", "name in the scheduler's registry (default: role-host-random)")
    scheduler: str = setting("127.0.0.1:50052", "the scheduler's gRPC address")
    nats_url: str = setting("nats://127.0.0.1:4222", "NATS for load reports and KV events")
    metrics_port: int = setting(0, "Prometheus /metrics port (0: any free port)")
    load_interval: float = setting(0.5, "seconds between load reports (heartbeats)")
    kv_transports: list[str] | None = setting(
        None,
        "KV transports this worker speaks, comma-separated: tcp, cuda_ipc, nccl "
        "(default: tcp, plus cuda_ipc on CUDA)",
    )
    kvstore: str = setting("", "the KV store's gRPC address (empty: no shared tier)")
    kv_write_through: str = setting(
        "selective",
        "what goes to the shared tier after a request: none; selective (the prompt's blocks "
        "it found cached here: a block goes down once it is reused); prefix (every full "
        "block of the prompt); all (also the generated tokens' blocks)",
        choices=WRITE_THROUGH,
    )
    kv_write_queue_bytes: int = setting(
        2 << 30,
        "KV bytes waiting to be written to the shared tier at most (an 8k-token llama3-8b "
        "prompt is 1 GiB); the blocks of a write beyond it (its tail) are dropped and counted "
        "(yinian:kv_shared_dropped_blocks), never waited for; what waits now is "
        "yinian:kv_shared_pending_bytes",
    )
    kv_verify_lent_blocks: bool = setting(
        False,
        "check the checksum of every block the KV store on this host lends (read from its "
        "shared memory, guarded by the lend) while copying it to the device: ~15 ms more per "
        "GiB on an H200 host; blocks that come by value or through the host tier are always "
        "checked",
    )
    kv_lend: bool = setting(
        True,
        "copy the blocks a KV store on this host holds straight from its memory tier to the "
        "device: this worker maps that tier and (on CUDA) pins it after start (seconds, and "
        "as much host memory as the tier); --no-kv-lend: they come through the host tier",
    )
    switch_interval: float = setting(
        0.005,
        "seconds a thread asking for the GIL waits before the running one must give it up "
        "(sys.setswitchinterval; 0.005 is Python's): the engine's thread and the service's "
        "loop share the interpreter, so this bounds how long either waits for the other",
    )
    drain_timeout: float = setting(
        30.0,
        "on SIGTERM, seconds the worker, already out of placement, lets its streams finish "
        "before it ends them (the gateway moves what is left to another worker)",
    )
    expert_parallel: bool = setting(
        False,
        "MoE models: compute the routed experts on the expert services the scheduler's "
        "balancer places (attention, dense layers and shared experts stay here)",
    )
    expert_fallback: str = setting(
        "replicas",
        "when an expert service is lost: replicas (its tokens go to surviving replicas; "
        "experts without one are computed here) or local (computed here)",
        choices=FALLBACKS,
    )
    expert_timeout: float = setting(
        5.0, "seconds an expert all-to-all may take before the step computes its experts here"
    )
    expert_transport: str = setting(
        "auto",
        "how activations reach the expert services: shared (buffers in host shared memory, "
        "CUDA IPC on the GPU: services on this host only), collective (gloo/NCCL "
        "all-to-alls), auto (shared where every service of the group can map them, "
        "else collective), or stream (every service gets every token and answers with its "
        "part, handed over in stream order with no host in the loop; this host only, and on "
        "a GPU a service that dies mid-step stalls the worker: never chosen by auto)",
        choices=TRANSPORTS,
    )
    engine_options: dict = not_a_flag(dict)

    def __post_init__(self) -> None:
        for name in self.kv_transports or ():
            if name not in KV_TRANSPORTS:
                raise ValueError(f"unknown KV transport {name!r}; known: {KV_TRANSPORTS}")
        if self.kv_write_through not in WRITE_THROUGH:
            raise ValueError(f"kv_write_through must be one of {WRITE_THROUGH}")
        if self.kv_write_queue_bytes < 0:
            raise ValueError("kv_write_queue_bytes must be >= 0")
        if self.load_interval <= 0:
            raise ValueError("load_interval must be > 0")
        if not 0 < self.switch_interval <= 1:
            raise ValueError("switch_interval must be > 0 and at most 1 second")
        if self.drain_timeout < 0:
            raise ValueError("drain_timeout must be >= 0")
        if self.expert_fallback not in FALLBACKS or self.expert_timeout <= 0:
            raise ValueError("expert_fallback must be replicas or local; expert_timeout > 0")
        if self.expert_transport not in TRANSPORTS:
            raise ValueError(f"expert_transport must be one of {TRANSPORTS}")
        TlsSettings.__post_init__(self)
        if not self.worker_id:
            self.worker_id = f"{self.role}-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"

    @property
    def role(self) -> str:  # pragma: no cover - each service's config names its role
        raise NotImplementedError

    @property
    def address_host(self) -> str:
        """The host peers reach this worker at."""
        return self.advertise_host or self.host

    def transports(self, device_type: str) -> list[str]:
        return self.kv_transports or (["cuda_ipc", "tcp"] if device_type == "cuda" else ["tcp"])


def parse_worker_config(cls, argv: list[str] | None, description: str):
    """A worker service's flags: its config's fields plus the engine options."""
    return parse_config(
        cls,
        argv,
        description,
        extend=add_engine_args,
        extra=lambda args: {"engine_options": engine_options(args)},
    )
