"""A worker's data-path group with its expert services: the worker hosts the
TCPStore rendezvous (rank 0), each member joins at the address the worker
hands it over gRPC (`Expert.Join`), and the group lives until the member set
changes or a collective fails (then it is aborted, which ends the members'
waits at once, and a new one is formed without the dead member). Members on
the worker's host may instead open mailboxes the worker made (`shared`:
services/expert_parallel/mailbox.py), with no rendezvous and no process group."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from services.expert_parallel.mailbox import MailboxPort
from services.expert_parallel.placement import Member
from services.expert_parallel.wire import WorkerPort
from services.kv_transport.nccl_group import abort_group, make_group

logger = logging.getLogger(__name__)


def model_tag(model: str | Path) -> str:
    """What a worker and its expert services must agree on: the model folder's
    name and a digest of its config."""
    path = Path(model)
    config = path / "config.json"
    digest = hashlib.sha256(config.read_bytes()).hexdigest()[:12] if config.is_file() else ""
    return f"{path.name}-{digest}"


@dataclass
class Rendezvous:
    """Where the members meet the worker: a store this worker hosts."""

    group_id: str
    host: str
    store: dist.TCPStore
    world: int
    backend: str

    @property
    def port(self) -> int:
        return self.store.port

    @classmethod
    def open(cls, host: str, world: int, backend: str, timeout: float) -> Rendezvous:
        store = dist.TCPStore(host, 0, None, True, timedelta(seconds=timeout),
                              wait_for_workers=False)  # fmt: skip
        return cls(uuid.uuid4().hex[:12], host, store, world, backend)


@dataclass
class ExpertGroup:
    """The worker's end of one formed group."""

    members: tuple[Member, ...]
    pg: object  # None over mailboxes
    port: WorkerPort | MailboxPort
    rendezvous: Rendezvous | None
    closed: bool = field(default=False)

    @classmethod
    def form(cls, rendezvous: Rendezvous, members: tuple[Member, ...], timeout: float,
             device: torch.device) -> ExpertGroup:  # fmt: skip
        """Blocks until every member has joined (or raises after `timeout`). The
        group's collectives time out after `timeout` too: a member that hangs
        fails the step's dispatch rather than the stream."""
        pg = make_group(rendezvous.backend, rendezvous.store, 0, timeout, rendezvous.host,
                        rendezvous.world)  # fmt: skip
        return cls(members, pg, WorkerPort(pg, rendezvous.world, device), rendezvous)

    @classmethod
    def shared(cls, members: tuple[Member, ...], port: MailboxPort) -> ExpertGroup:
        """A group whose members opened their mailboxes (no process group)."""
        port.opened()
        return cls(members, None, port, None)

    @property
    def transport(self) -> str:
        if self.pg is not None:
            return "collective"
        return "stream" if getattr(self.port, "partial", False) else "shared"

    @property
    def member_ids(self) -> tuple[str, ...]:
        return tuple(m.expert_id for m in self.members)

    def close(self, graceful: bool) -> None:
        """Graceful: tell the members to stop serving this group first."""
        if self.closed:
            return
        self.closed = True
        if self.pg is None:  # mailboxes: closing is leaving
            self.port.close()
            return
        if graceful:
            with contextlib.suppress(Exception):
                self.port.leave()
        abort_group(self.pg)
