"""A placement: which logical expert each physical slot holds (`phy2log`), on
which expert service each slot lives, and the derived `log2phy` / `logcnt`
the workers route by. Shared by the balancer (makes them), the expert
services (load what they are given) and the workers (route tokens).

A slot may be empty (-1): its service is gone, or the worker computes that
expert itself; an expert with no slot left (`logcnt` 0) is computed locally.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from proto.yinian.v1 import expert_pb2


@dataclass(frozen=True, slots=True)
class Member:
    expert_id: str
    address: str
    host: str = ""
    device: str = ""


@dataclass(frozen=True)
class Placement:
    version: int
    members: tuple[Member, ...]
    slots_per_member: int
    phy2log: torch.Tensor  # [L, R] int64; -1: an empty slot
    num_experts: int
    model: str = ""
    log2phy: torch.Tensor = field(init=False, repr=False)  # [L, E, maxcnt], -1 padded
    logcnt: torch.Tensor = field(init=False, repr=False)  # [L, E]
    unplaced: list[bool] = field(init=False, repr=False)  # per layer: an expert without a slot
    _on_device: dict = field(init=False, repr=False, compare=False)  # device -> tables

    def __post_init__(self) -> None:
        layers, slots = self.phy2log.shape
        if slots != len(self.members) * self.slots_per_member:
            raise ValueError(f"{slots} slots for {len(self.members)} members of "
                             f"{self.slots_per_member}")  # fmt: skip
        if self.phy2log.numel() and int(self.phy2log.max()) >= self.num_experts:
            raise ValueError("a slot names an expert the model does not have")
        held = self.phy2log >= 0
        logcnt = torch.zeros(layers, self.num_experts, dtype=torch.int64)
        logcnt.scatter_add_(1, self.phy2log.clamp(min=0), held.long())
        width = max(1, int(logcnt.max()) if logcnt.numel() else 1)
        log2phy = torch.full((layers, self.num_experts, width), -1, dtype=torch.int64)
        for layer in range(layers):  # replicas in slot order
            seen = [0] * self.num_experts
            for slot, expert in enumerate(self.phy2log[layer].tolist()):
                if expert >= 0:
                    log2phy[layer, expert, seen[expert]] = slot
                    seen[expert] += 1
        object.__setattr__(self, "log2phy", log2phy)
        object.__setattr__(self, "logcnt", logcnt)
        object.__setattr__(self, "unplaced", (logcnt == 0).any(dim=1).tolist())
        object.__setattr__(self, "_on_device", {})

    @classmethod
    def empty(cls, num_layers: int, num_experts: int, model: str = "") -> Placement:
        """Version 0: no expert service; the workers compute every expert."""
        return cls(0, (), 0, torch.empty(num_layers, 0, dtype=torch.int64), num_experts, model)

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(logcnt, log2phy) on `device`, copied there once: a copy from pageable host
        memory each dispatch would be a host sync per MoE layer on a GPU."""
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = (self.logcnt.to(device), self.log2phy.to(device))
        return self._on_device[key]

    def has_local(self, layer: int) -> bool:
        """Whether some expert of MoE layer `layer` has no slot (its worker computes it)."""
        return self.unplaced[layer]

    def slots_of(self, member: int) -> torch.Tensor:
        """[L, slots_per_member]: the experts member `member` holds (-1: none)."""
        start = member * self.slots_per_member
        return self.phy2log[:, start : start + self.slots_per_member]

    def experts_of(self, member: int) -> list[list[int]]:
        """Per layer, the distinct logical experts member `member` must hold."""
        return [sorted({e for e in row if e >= 0}) for row in self.slots_of(member).tolist()]

    def route(self, layer: int, expert_ids: torch.Tensor, turn: int = 0) -> torch.Tensor:
        """The slot each (token, k) pair of flat `expert_ids` goes to, -1 for
        experts without one. An expert's pairs take its replicas in turn, starting
        at `turn` (the caller advances it per dispatch, so that even one pair per
        dispatch spreads). Not by flat position, as vLLM does: with an even top-k
        a hot expert, usually at the same k, would land on one replica."""
        logcnt, log2phy = self.tables(expert_ids.device)
        device = expert_ids.device
        counts = logcnt[layer][expert_ids]
        order = torch.argsort(expert_ids, stable=True)
        ordered = expert_ids[order]
        # each pair's place among its expert's pairs
        nth = torch.empty_like(order)
        nth[order] = torch.arange(len(order), device=device) - torch.searchsorted(ordered, ordered)
        replica = (nth + turn) % counts.clamp(min=1)
        slots = log2phy[layer][expert_ids, replica]
        return torch.where(counts > 0, slots, -1)

    def without(self, lost: set[str], keep_replicas: bool) -> Placement:
        """The same placement over the members not in `lost` (same version). Their
        slots go; with `keep_replicas` False, so do the other replicas of every
        expert that had one on a lost member (the worker computes those itself)."""
        keep = [i for i, m in enumerate(self.members) if m.expert_id not in lost]
        spm = self.slots_per_member
        columns = [i * spm + j for i in keep for j in range(spm)]
        phy2log = self.phy2log[:, columns].clone()
        if not keep_replicas:
            for layer in range(self.num_layers):
                gone = {e for i, m in enumerate(self.members) if m.expert_id in lost
                        for e in self.slots_of(i)[layer].tolist() if e >= 0}  # fmt: skip
                for expert in gone:
                    phy2log[layer][phy2log[layer] == expert] = -1
        members = tuple(self.members[i] for i in keep)
        return Placement(self.version, members, spm, phy2log, self.num_experts, self.model)

    # -- the wire ------------------------------------------------------------
    def to_message(self) -> expert_pb2.ExpertPlacement:
        return expert_pb2.ExpertPlacement(
            version=self.version,
            members=[
                expert_pb2.ExpertMember(
                    expert_id=m.expert_id, address=m.address, host=m.host, device=m.device
                )
                for m in self.members
            ],  # fmt: skip
            slots_per_member=self.slots_per_member,
            num_moe_layers=self.num_layers,
            num_experts=self.num_experts,
            phy2log=self.phy2log.flatten().tolist(),
            model=self.model,
        )

    @classmethod
    def from_message(cls, msg: expert_pb2.ExpertPlacement) -> Placement:
        members = tuple(Member(m.expert_id, m.address, m.host, m.device) for m in msg.members)
        slots = len(members) * msg.slots_per_member
        if len(msg.phy2log) != msg.num_moe_layers * slots:
            raise ValueError(f"placement {msg.version}: {len(msg.phy2log)} phy2log entries "
                             f"for {msg.num_moe_layers} layers x {slots} slots")  # fmt: skip
        phy2log = torch.tensor(list(msg.phy2log), dtype=torch.int64).view(msg.num_moe_layers, slots)
        return cls(msg.version, members, msg.slots_per_member, phy2log, msg.num_experts,
                   msg.model)  # fmt: skip


def expert_set(version: int, per_layer: list[list[int]]) -> expert_pb2.ExpertSet:
    """Per layer, a service's experts as an ExpertSet message."""
    offsets, flat = [0], []
    for experts in per_layer:
        flat += experts
        offsets.append(len(flat))
    return expert_pb2.ExpertSet(version=version, layer_offsets=offsets, experts=flat)


def expert_lists(msg: expert_pb2.ExpertSet) -> list[list[int]]:
    offsets, flat = list(msg.layer_offsets), list(msg.experts)
    if not offsets or offsets[-1] != len(flat) or offsets != sorted(offsets):
        raise ValueError("ExpertSet: layer_offsets must rise from 0 to len(experts)")
    return [flat[a:b] for a, b in zip(offsets, offsets[1:])]
