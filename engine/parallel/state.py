"""This process's place in a parallel engine, and its process groups.

Ranks are laid out stage-major: rank = stage * tp_size + tp_rank. The ranks of
one stage form its tensor-parallel group; rank 0 (stage 0, tensor rank 0)
hosts the engine's scheduler and drives every step.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(slots=True)
class ParallelState:
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_stage: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tp_group: object | None = None  # a torch.distributed group, or None alone

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        return self.pp_stage * self.tp_size + self.tp_rank

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def first_stage(self) -> bool:
        return self.pp_stage == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_stage == self.pp_size - 1

    def stage_rank(self, stage: int) -> int:
        """The global rank of this tensor rank in another stage."""
        return stage * self.tp_size + self.tp_rank

    @property
    def tp_ranks(self) -> list[int]:
        return [self.stage_rank(self.pp_stage) - self.tp_rank + r for r in range(self.tp_size)]


_STATE = ParallelState()


def current() -> ParallelState:
    return _STATE


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def initialize(
    tp_size: int, pp_size: int, rank: int, store_address: str, device: torch.device,
    timeout: float = 60.0,
) -> ParallelState:  # fmt: skip
    """Joins the engine's process group (rank 0 hosts the TCPStore) and makes this
    stage's tensor-parallel group. Every rank calls it with the same sizes."""
    global _STATE
    world = tp_size * pp_size
    host, port = store_address.rsplit(":", 1)
    store = dist.TCPStore(
        host, int(port), world, is_master=rank == 0,
        timeout=datetime.timedelta(seconds=timeout),
    )  # fmt: skip
    dist.init_process_group(
        backend_for(device), store=store, rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )  # fmt: skip
    state = ParallelState(tp_size, rank % tp_size, pp_size, rank // tp_size, device)
    # every rank makes every stage's group, in the same order (new_group is collective)
    for stage in range(pp_size):
        ranks = [stage * tp_size + r for r in range(tp_size)]
        group = dist.new_group(ranks) if tp_size > 1 else None
        if stage == state.pp_stage:
            state.tp_group = group
    _STATE = state
    return state


def shutdown() -> None:
    global _STATE
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE = ParallelState()
