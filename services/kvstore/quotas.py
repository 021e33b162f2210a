"""How many bytes each tenant may keep in the shared tier: one default for
every tenant, overridden per tenant by a file of `tenant bytes` lines
(`#` starts a comment; `""` names the default tenant)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True)
class Quotas:
    capacity: int  # the shared tier's total; no quota exceeds it
    default: int = 0  # 0: the whole capacity
    overrides: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.capacity <= 0:
            raise ValueError("capacity must be > 0")
        if self.default < 0 or any(v < 0 for v in self.overrides.values()):
            raise ValueError("quotas must be >= 0")

    def for_tenant(self, tenant: str) -> int:
        quota = self.overrides.get(tenant, self.default)
        return min(quota, self.capacity) if quota else self.capacity

    @classmethod
    def load(cls, path: str | Path | None, capacity: int, default: int = 0) -> Quotas:
        return cls(capacity, default, parse_quota_file(Path(path).read_text()) if path else {})


def parse_quota_file(text: str) -> dict[str, int]:
    quotas: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            raise ValueError(f"quota file line {number}: expected 'tenant bytes', got {raw!r}")
        tenant = "" if parts[0] == '""' else parts[0]
        quotas[tenant] = int(parts[1])
    return quotas
