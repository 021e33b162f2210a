"""The prefill worker's settings: a worker's settings with the prefill role."""

from __future__ import annotations

from services.decode.config import WorkerConfig, parse


def parse_prefill(argv: list[str] | None = None) -> WorkerConfig:
    return parse(argv, role="prefill")


__all__ = ["WorkerConfig", "parse_prefill"]
