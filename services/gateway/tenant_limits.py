"""What each tenant may use: requests and tokens per minute (token buckets), requests
at once, and a priority. Read from a JSON file (`--tenant-limits`), reloaded on SIGHUP:

    {"*":     {"requests_per_minute": 600, "max_concurrent": 16},
     "alpha": {"requests_per_minute": 60, "burst": 10, "tokens_per_minute": 100000,
               "priority": 0},
     "batch": {"max_concurrent": 4, "priority": 10}}

"*" holds for tenants not named (absent: no limits). A field left out is no limit. A
request's tokens are its prompt plus max_tokens for each of its n outputs, as OpenAI
counts them at admission. Priorities are as the engine orders them (lower first): a
tenant's priority is the lowest (most urgent) its requests may ask for.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path


def _finite_positive(value) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value)) and value > 0
    except OverflowError:  # an integer past a float's range
        return False


@dataclass(slots=True, frozen=True)
class TenantLimits:
    requests_per_minute: float | None = None
    burst: float | None = None  # requests a full bucket holds (default: a minute's)
    tokens_per_minute: float | None = None
    max_concurrent: int | None = None
    priority: int | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "burst", "tokens_per_minute"):
            value = getattr(self, name)
            if value is None:
                continue
            if not _finite_positive(value):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.burst is not None and self.requests_per_minute is None:
            raise ValueError("burst needs requests_per_minute")
        if self.burst is not None and self.burst < 1:
            raise ValueError(f"burst must be >= 1 (a request takes 1), got {self.burst!r}")
        for name in ("max_concurrent", "priority"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {self.max_concurrent}")

    @property
    def request_bucket(self) -> float:
        """Requests a full bucket holds."""
        return self.burst or self.requests_per_minute or 0.0

    @property
    def limited(self) -> bool:
        return any(
            v is not None
            for v in (self.requests_per_minute, self.tokens_per_minute, self.max_concurrent)
        )


NO_LIMITS = TenantLimits()
_FIELDS = {f.name for f in fields(TenantLimits)}


@dataclass(slots=True, frozen=True)
class LimitTable:
    tenants: dict[str, TenantLimits]
    default: TenantLimits = NO_LIMITS

    def of(self, tenant: str) -> TenantLimits:
        return self.tenants.get(tenant, self.default)

    @property
    def empty(self) -> bool:
        return not self.tenants and self.default == NO_LIMITS


def load_limits(path: str | None) -> LimitTable:
    """The table in `path` (none: no limits); ValueError naming what is wrong."""
    if not path:
        return LimitTable({})
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"tenant limits {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"tenant limits {path}: a JSON object of tenant -> limits")
    table: dict[str, TenantLimits] = {}
    for tenant, spec in raw.items():
        if not isinstance(spec, dict) or set(spec) - _FIELDS:
            unknown = sorted(set(spec) - _FIELDS) if isinstance(spec, dict) else spec
            raise ValueError(f"tenant limits {path}: {tenant!r}: unknown {unknown}")
        try:
            table[tenant] = TenantLimits(**spec)
        except ValueError as exc:
            raise ValueError(f"tenant limits {path}: {tenant!r}: {exc}") from exc
    default = table.pop("*", NO_LIMITS)
    return LimitTable(table, default)
