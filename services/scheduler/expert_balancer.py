"""The expert balancer's state, free of gRPC: which expert services exist (they
register, then heartbeat with their NATS load reports), the placement served
now, the load gathered since it was applied, which placement each worker
routes by, and the EPLB plan for a new placement.

Load comes from the services: each counts the tokens it computed per
(layer, logical expert); summed over services that is each expert's load.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from services.expert_parallel.eplb import imbalance, rebalance_experts
from services.expert_parallel.placement import Member, Placement

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ExpertService:
    expert_id: str
    address: str
    host: str
    device: str
    slots: int
    last_seen: float
    held_version: int = 0

    @property
    def member(self) -> Member:
        return Member(self.expert_id, self.address, self.host, self.device)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What every expert service of one balancer must share."""

    model: str
    num_layers: int
    num_experts: int
    hidden_size: int
    dtype: str


class ExpertBalancer:
    def __init__(self, redundant_slots: int = 0, heartbeat_timeout: float = 2.0,
                 num_groups: int = 1, clock=time.monotonic):  # fmt: skip
        if redundant_slots < 0:
            raise ValueError("redundant_slots must be >= 0")
        self.redundant_slots = redundant_slots
        self.heartbeat_timeout = heartbeat_timeout
        self.num_groups = num_groups
        self.clock = clock
        self.services: dict[str, ExpertService] = {}
        self.shape: ModelShape | None = None
        self.placement: Placement | None = None
        self.window: torch.Tensor | None = None  # [L, E] tokens since the placement
        self.member_tokens: torch.Tensor | None = None  # [L, members] since the placement
        self.workers: dict[str, tuple[int, float]] = {}  # id -> (applied version, seen)
        self.changed_at = clock()
        self.rebalances = 0

    # -- membership ------------------------------------------------------------
    def register(self, info) -> bool:
        """Adds (or refreshes) a service; True when it is new. A service of another
        model or shape is a ValueError."""
        shape = ModelShape(info.model, info.num_moe_layers, info.num_experts, info.hidden_size,
                           info.dtype)  # fmt: skip
        if info.slots < 1 or not info.expert_id or not info.address:
            raise ValueError("an expert service needs an id, an address and slots >= 1")
        if self.shape is not None and shape != self.shape and self.services:
            raise ValueError(f"expert service {info.expert_id} serves {shape}, the others "
                             f"{self.shape}")  # fmt: skip
        if self.shape != shape:
            self.shape, self.placement = shape, None
            self.window = torch.zeros(shape.num_layers, shape.num_experts, dtype=torch.float64)
        new = info.expert_id not in self.services
        self.services[info.expert_id] = ExpertService(
            info.expert_id, info.address, info.host, info.device, info.slots, self.clock()
        )
        if new:
            self.changed_at = self.clock()
        return new

    def deregister(self, expert_id: str) -> bool:
        if self.services.pop(expert_id, None) is None:
            return False
        self.changed_at = self.clock()
        return True

    def on_load(self, report) -> None:
        service = self.services.get(report.expert_id)
        if service is None or self.shape is None:
            return
        service.last_seen = self.clock()
        service.held_version = report.held_version
        if not report.counts:
            return
        layers, experts = self.shape.num_layers, self.shape.num_experts
        if len(report.counts) != layers * experts:
            logger.warning("dropping a load report of %d counts from %s", len(report.counts),
                           report.expert_id)  # fmt: skip
            return
        counts = torch.tensor(list(report.counts), dtype=torch.float64).view(layers, experts)
        self.window += counts
        index = self._member_index(report.expert_id)
        if index is not None and self.member_tokens is not None:
            self.member_tokens[:, index] += counts.sum(-1)

    def touch_all(self) -> None:
        """No report can arrive while NATS is away: no sign of a dead service."""
        now = self.clock()
        for service in self.services.values():
            service.last_seen = now

    def expire(self) -> list[str]:
        """Drops services whose reports stopped; returns their ids."""
        now = self.clock()
        gone = [s.expert_id for s in self.services.values()
                if now - s.last_seen > self.heartbeat_timeout]  # fmt: skip
        for expert_id in gone:
            self.deregister(expert_id)
        return gone

    def lost_members(self) -> list[str]:
        """Members of the placement served now that are no longer registered."""
        if self.placement is None:
            return []
        return [m.expert_id for m in self.placement.members if m.expert_id not in self.services]

    # -- workers -------------------------------------------------------------
    def worker_seen(self, worker_id: str, applied_version: int) -> None:
        self.workers[worker_id] = (applied_version, self.clock())

    def workers_on(self, version: int) -> tuple[list[str], bool]:
        """(workers routing by `version`, whether every live worker is past older ones)."""
        now = self.clock()
        live = {w: v for w, (v, seen) in self.workers.items()
                if now - seen <= self.heartbeat_timeout}  # fmt: skip
        self.workers = {w: self.workers[w] for w in live}
        return sorted(w for w, v in live.items() if v == version), all(
            v >= version for v in live.values()
        )

    # -- placements ----------------------------------------------------------
    def plan(self) -> Placement | None:
        """EPLB over the live services on the load gathered so far (uniform when
        none); None when there is no service or too few slots for every expert."""
        if self.shape is None or not self.services:
            return None
        members = sorted(self.services.values(), key=lambda s: (s.host, s.expert_id))
        experts, count = self.shape.num_experts, len(members)
        per_member = min(min(s.slots for s in members),
                         math.ceil((experts + self.redundant_slots) / count))  # fmt: skip
        if per_member * count < experts:
            logger.warning("%d services x %d slots cannot hold %d experts", count, per_member,
                           experts)  # fmt: skip
            return None
        weight = self.window if self.window.sum() > 0 else torch.ones_like(self.window)
        hosts = [s.host for s in members]
        nodes = len(set(hosts))
        if count % nodes or any(hosts.count(h) != count // nodes for h in set(hosts)):
            nodes = 1  # uneven hosts: the global policy
        result = rebalance_experts(weight, per_member * count, self.num_groups, nodes, count)
        version = (self.placement.version if self.placement is not None else 0) + 1
        return Placement(version, tuple(s.member for s in members), per_member, result.phy2log,
                         experts, self.shape.model)  # fmt: skip

    def degraded(self, lost: set[str]) -> Placement | None:
        """The served placement without `lost` members, as a new version (experts
        left without a slot are computed by the workers)."""
        if self.placement is None:
            return None
        kept = self.placement.without(lost, keep_replicas=True)
        return Placement(self.placement.version + 1, kept.members, kept.slots_per_member,
                         kept.phy2log, kept.num_experts, kept.model)  # fmt: skip

    def predicted_imbalance(self, placement: Placement | None) -> list[float]:
        """Per layer, max/mean tokens per service if the gathered load ran on it."""
        if placement is None or not placement.members or self.window is None:
            return []
        if self.window.sum() == 0:
            return []
        phy2log = placement.phy2log.clamp(min=0)  # an empty slot counts as expert 0's
        return imbalance(self.window, phy2log, len(placement.members)).tolist()

    def adopt(self, placement: Placement) -> None:
        self.placement = placement
        self.rebalances += 1
        self.window.zero_()
        self.member_tokens = torch.zeros(placement.num_layers, len(placement.members),
                                         dtype=torch.float64)  # fmt: skip

    def measured_imbalance(self) -> tuple[list[float], list[float]]:
        """(per layer max/mean tokens per member, tokens per member) since the
        placement was applied, from the services' reports."""
        tokens = self.member_tokens
        if tokens is None or tokens.numel() == 0 or tokens.sum() == 0:
            return [], []
        mean = tokens.mean(-1).clamp(min=1e-12)
        return (tokens.max(-1).values / mean).tolist(), tokens.sum(0).tolist()

    def _member_index(self, expert_id: str) -> int | None:
        if self.placement is None:
            return None
        for i, member in enumerate(self.placement.members):
            if member.expert_id == expert_id:
                return i
        return None
