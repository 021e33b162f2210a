"""The gateway's settings, from flags or YINIAN_* environment variables."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)
class GatewayConfig:
    model: str
    served_model_name: str = ""
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051
    scheduler: str = "127.0.0.1:50052"
    api_keys: str | None = None
    allow_unauthenticated: bool = False
    max_model_len: int | None = None
    block_size: int = 16
    request_timeout: float = 600.0
    idle_timeout: float = 120.0
    max_migrations: int = 2

    def __post_init__(self) -> None:
        if not self.served_model_name:
            self.served_model_name = Path(self.model).name
        if self.max_migrations < 0:
            raise ValueError("max_migrations must be >= 0")
        for name in ("request_timeout", "idle_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")


def parse(argv: list[str] | None = None) -> GatewayConfig:
    env = os.environ.get
    p = argparse.ArgumentParser(description="yinian gateway")
    p.add_argument("--model", default=env("YINIAN_MODEL"), required=env("YINIAN_MODEL") is None)
    p.add_argument("--served-model-name", default=env("YINIAN_SERVED_MODEL_NAME", ""))
    p.add_argument("--host", default=env("YINIAN_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env("YINIAN_PORT", "8000")))
    p.add_argument("--grpc-port", type=int, default=int(env("YINIAN_GRPC_PORT", "50051")))
    p.add_argument("--scheduler", default=env("YINIAN_SCHEDULER", "127.0.0.1:50052"))
    p.add_argument(
        "--api-keys",
        default=env("YINIAN_API_KEYS_FILE"),
        help="file of API keys ('key tenant' per line, or JSON {key: tenant})",
    )
    p.add_argument("--allow-unauthenticated", action="store_true")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--idle-timeout", type=float, default=120.0)
    p.add_argument(
        "--max-migrations",
        type=int,
        default=2,
        help="times a stream may move to another worker when its worker dies",
    )
    a = p.parse_args(argv)
    return GatewayConfig(
        a.model,
        a.served_model_name,
        a.host,
        a.port,
        a.grpc_port,
        a.scheduler,
        a.api_keys,
        a.allow_unauthenticated,
        a.max_model_len,
        a.block_size,
        a.request_timeout,
        a.idle_timeout,
        a.max_migrations,
    )
