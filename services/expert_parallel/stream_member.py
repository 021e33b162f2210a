"""An expert service's end of a worker's stream port (services/expert_parallel/
stream_port.py): mapped from the description the worker sent in Join; then
`receive` (the next dispatch of any slot) and `reply` (this member's partial
sum), on the thread that serves the group."""

from __future__ import annotations

import io
import os
from pathlib import Path

import torch

from basis.host_regions import pid_alive
from services.expert_parallel.mailbox import MailboxError
from services.expert_parallel.mailbox_member import check_mapped, member_device, worker_pid
from services.expert_parallel.stream_flags import FlagError, StreamFlags, poll
from services.expert_parallel.stream_port import (
    control_index,
    flag_count,
    flag_index,
    shared_tensor,
)
from services.kv_transport.cuda_ipc import PlainUnpickler, open_remote


class _Stopped(Exception):
    pass


class StreamMember:
    """Raises MailboxError where this process cannot map the worker's buffers."""

    def __init__(self, description: bytes, device: torch.device):
        self._stopping = False
        self.flags = None
        try:
            self._open(PlainUnpickler(io.BytesIO(description)).load(), device)
        except MailboxError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever stops the mapping
            raise MailboxError(f"cannot open the worker's expert stream: {exc}") from exc

    def _open(self, desc: dict, device: torch.device) -> None:
        if desc.get("version") != 1 or desc.get("kind") != "stream":
            raise MailboxError("not a version-1 expert stream description")
        on_gpu = desc["cuda"] is not None
        self.device = device = member_device(device, on_gpu)
        self.member, self.slots = desc["member"], desc["slots"]
        members = desc["members"]
        self.flags = StreamFlags(Path(desc["flags"]), flag_count(members, self.slots), device,
                                 create=False)  # fmt: skip
        self.control = control_index(members, self.slots)
        dtype = getattr(torch, desc["dtype"])
        slots, capacity, hidden, top_k = self.slots, desc["capacity"], desc["hidden"], desc["top_k"]
        if on_gpu:
            cuda = desc["cuda"]
            self.tokens, self.weights, ids, out = (
                open_remote(cuda[k])[0] for k in ("hidden", "weights", "ids", "out")
            )
            check_mapped(self.tokens, device)
        else:
            paths = desc["paths"]
            self.tokens = shared_tensor(Path(paths["hidden"]), (slots, capacity, hidden), dtype)
            self.weights = shared_tensor(Path(paths["weights"]), (slots, capacity, top_k),
                                         torch.float32)  # fmt: skip
            ids = shared_tensor(Path(paths["ids"]), (members, slots, capacity, top_k), torch.int32)
            out = shared_tensor(Path(paths["out"]), (members, slots, capacity, hidden), dtype)
        self.ids, self.out = ids[self.member], out[self.member]  # this member's part
        self.worker_pid = worker_pid(desc)
        pid = os.getpid() if self.worker_pid is not None else 0
        self.flags.host[self.control["pid"] + self.member] = pid
        self._sent = [flag_index(self.member, s, self.slots)[0] for s in range(self.slots)]
        self._taken = [flag_index(self.member, s, self.slots)[2] for s in range(self.slots)]
        self._slot = self._rows = None
        self._turn = 0

    def receive(self) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(layer, tokens [T, H], weights [T, k], expert ids [T, k]: -1 where the
        pair is another member's): views valid until `reply`; None once the worker
        closed the stream, is gone, or `stop()` was called."""
        host = self.flags.host
        try:
            value = poll(host, 0, lambda _: self._any_sent(), self._alive, timeout=float("inf"))
        except (_Stopped, FlagError):
            return None
        del value
        slot = self._slot_seen
        sent = host[self._sent[slot]]
        host[self._taken[slot]] = sent  # until the worker has our answer (for a stand-in)
        host[self._sent[slot]] = 0  # seen: the worker writes it again only after our reply
        layer, rows = (sent >> 32) - 1, sent & 0xFFFFFFFF
        self._slot, self._rows = slot, rows
        return layer, self.tokens[slot, :rows], self.weights[slot, :rows], self.ids[slot, :rows]

    def _any_sent(self) -> bool:
        host = self.flags.host
        for k in range(self.slots):
            slot = (self._turn + k) % self.slots
            if host[self._sent[slot]]:
                self._slot_seen, self._turn = slot, slot + 1
                return True
        return False

    def _alive(self) -> None:
        host = self.flags.host
        if self._stopping or host[self.control["closed"]]:
            raise _Stopped
        if self.worker_pid is not None and not pid_alive(self.worker_pid):
            raise _Stopped

    @property
    def slot(self) -> int | None:
        """The slot of the dispatch received and not answered yet."""
        return self._slot

    def reply(self, partial: torch.Tensor, keep: bool = False) -> None:
        """This member's partial sum of the last received dispatch, [T, H]. `keep`:
        the reply is being captured in a CUDA graph (it happens at `replied()`)."""
        slot = self._slot
        if slot is None or partial.shape[0] != self._rows:
            raise MailboxError(f"{partial.shape[0]} outputs for {self._rows} tokens")
        self.out[slot, : self._rows].copy_(partial, non_blocking=True)
        self.flags.write(flag_index(self.member, slot, self.slots)[1], 1)
        if not keep:
            self._slot = None

    def replied(self) -> None:
        """A captured reply was replayed: the dispatch is answered."""
        self._slot = None

    def stop(self) -> None:
        """Ends the serving loop from another thread (within 0.1 s)."""
        self._stopping = True

    def close(self) -> None:
        """The serving thread's last word: gone (the worker stops waiting on it)."""
        if self.flags is not None:
            self.flags.host[self.control["gone"] + self.member] = 1
