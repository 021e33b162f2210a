"""The gateway's settings; each field is a flag (and a YINIAN_* variable)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from basis.flags import parse_config, setting
from services.common.tls import TlsSettings


@dataclass(slots=True)
class GatewayConfig(TlsSettings):
    model: str = setting(help="model folder: its tokenizer, chat template and config.json")
    served_model_name: str = setting("", "the model's name in the API (default: the folder's)")
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "REST (OpenAI) port")
    grpc_port: int = setting(50051, "gRPC (yinian.v1.Inference) port")
    scheduler: str = setting("127.0.0.1:50052", "the scheduler's gRPC address")
    nats_url: str = setting(
        "",
        "NATS of the workers' load reports and KV events: with it the gateway places "
        "requests itself (no call to the scheduler a request); empty: the scheduler does",
    )
    placement: str = setting(
        "auto",
        "who places a request: the gateway (from the NATS events: needs --nats-url), the "
        "scheduler (one call a request), or auto (the gateway when it has --nats-url)",
        choices=("auto", "gateway", "scheduler"),
    )
    api_keys: str | None = setting(
        None,
        "file of API keys ('key tenant' per line, or JSON {key: tenant}); "
        "YINIAN_API_KEYS='key:tenant,...' adds more; read again on SIGHUP",
        env="YINIAN_API_KEYS_FILE",
    )
    tenant_limits: str | None = setting(
        None,
        "JSON file of per-tenant limits: requests and tokens per minute, requests at once, "
        "priority ('*' for every other tenant); reloaded with the keys on SIGHUP",
    )
    redis_url: str = setting(
        "", "Redis that gateways share tenant limits through (empty: limits per gateway)"
    )
    allow_unauthenticated: bool = setting(
        False, "serve without API keys on a non-loopback address", env=""
    )
    public_prefixes: str | None = setting(
        None,
        "JSON file of prefixes shared by every tenant's cache (system prompts): texts, "
        "{messages} or {token_ids}",
    )
    max_model_len: int | None = setting(
        None, "context length served (default: the model's max_position_embeddings)"
    )
    block_size: int = setting(
        16,
        "the workers' KV block size, for prefix-aware placement (a gateway placing requests "
        "itself hashes in the workers' own when they all share one)",
    )
    request_timeout: float = setting(600.0, "seconds a request may take end to end")
    idle_timeout: float = setting(
        120.0, "seconds a worker may stay silent (before a request's first token or between two)"
    )
    worker_links: bool = setting(
        True,
        "one multiplexed call per worker carries every request placed there (a step's "
        "tokens in one message); off: one Generate call a request",
    )
    max_migrations: int = setting(
        2, "times a stream may move to another worker when its worker dies"
    )
    max_body_bytes: int = setting(
        16 << 20,
        "largest request body read (413 above it, before reading it); also the largest "
        "gRPC request",
    )
    body_timeout: float = setting(
        30.0, "seconds a client may take to send its request body (408 after)"
    )
    header_timeout: float = setting(
        10.0, "seconds a connection may take to send a request's headers (408 and closed after)"
    )
    keep_alive_timeout: float = setting(
        5.0, "seconds an idle keep-alive connection stays open between requests"
    )
    max_connections: int = setting(
        10_000,
        "open HTTP connections at most (a new one past it gets 503 and is closed); "
        "lowered to what the process's file-descriptor limit allows",
    )
    drain_timeout: float = setting(
        2.0,
        "on SIGTERM, seconds the requests in flight (HTTP and gRPC) may take to finish before "
        "they are cut; new connections are refused at once",
    )
    tool_call_parser: str = setting(
        "",
        "how the model writes tool calls (default: read from its chat template)",
        choices=("", "hermes", "llama3_json"),
    )

    def __post_init__(self) -> None:
        if not self.served_model_name:
            self.served_model_name = Path(self.model).name
        if self.max_migrations < 0:
            raise ValueError("max_migrations must be >= 0")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.placement == "gateway" and not self.nats_url:
            raise ValueError("placement 'gateway' needs --nats-url (the workers' load reports)")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        if self.max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        if self.drain_timeout < 0:
            raise ValueError("drain_timeout must be >= 0")
        for name in ("request_timeout", "idle_timeout", "body_timeout", "header_timeout",
                     "keep_alive_timeout"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        TlsSettings.__post_init__(self)

    @property
    def places_itself(self) -> bool:
        """The gateway places requests (else the scheduler does)."""
        return self.placement != "scheduler" and bool(self.nats_url)


def parse(argv: list[str] | None = None) -> GatewayConfig:
    return parse_config(GatewayConfig, argv, "yinian gateway")
