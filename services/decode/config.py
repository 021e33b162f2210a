"""The decode service's settings: a worker's settings (services/worker/
settings.py) plus its role and its side of the KV handoff."""

from __future__ import annotations

from dataclasses import dataclass

from basis.flags import setting
from services.worker.settings import WorkerSettings, parse_worker_config

ROLES = ("colocated", "decode")


@dataclass(slots=True)
class DecodeConfig(WorkerSettings):
    role: str = setting(
        "colocated",
        "colocated: prefill and decode here; decode: prefill long prompts on a prefill "
        "worker and import their KV",
        choices=ROLES,
    )
    kv_lease_seconds: float = setting(
        30.0, "how long a prefill worker keeps handed-off blocks for us"
    )
    prefill_timeout: float = setting(120.0, "seconds a KV handoff may take before we prefill here")

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        for name in ("kv_lease_seconds", "prefill_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        WorkerSettings.__post_init__(self)


def parse(argv: list[str] | None = None) -> DecodeConfig:
    return parse_worker_config(DecodeConfig, argv, "yinian decode worker")
