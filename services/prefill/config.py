"""The prefill service's settings: a worker's settings (services/worker/
settings.py); its role is always `prefill`."""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.settings import WorkerSettings, parse_worker_config


@dataclass(slots=True)
class PrefillConfig(WorkerSettings):
    @property
    def role(self) -> str:
        return "prefill"


def parse(argv: list[str] | None = None) -> PrefillConfig:
    return parse_worker_config(PrefillConfig, argv, "yinian prefill worker")
