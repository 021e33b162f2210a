"""The worker's end of the stream-ordered expert path (transport `stream`): a MoE
layer's tokens handed to the expert services on the worker's GPU with no host
in the loop, so a step with expert services can be a CUDA graph.

Per dispatch every member gets the same tokens (hidden [T, H], routing weights
[T, k]) and its own expert ids [T, k]: the logical expert of each pair routed to
it, -1 for the others. It answers with its partial sum over its pairs (the fused
MoE over the experts it holds; the others add nothing) and the worker adds the
partials up. Nothing depends on how many pairs a member got, so the worker reads
no device value on the host, and every shape is fixed by T.

The buffers are the worker's (GPU memory the members map through CUDA IPC; on
the CPU, /dev/shm files). Per member and slot two flags in shared host memory
(services/expert_parallel/stream_flags.py) order the hand-off: the worker's
stream writes SENT = (layer + 1) << 32 | T once the tokens are in place; the
member's host sees it, resets it, queues its compute and has its stream write
REPLIED = 1 once the partial is in place; the worker's stream waits for
REPLIED == 1 and resets it. `slots` dispatches may be in flight (micro-batches).

Faults: once the worker `guard`s the port, a member found dead (its pid) or gone
(its loop ended) is answered for by the worker itself, from its own copy of the
experts (services/expert_parallel/stream_stand_in.py), so the waits in flight
end with the right sum, on a GPU (whose waits are the stream's) as on the CPU;
unguarded, the CPU's wait fails with MailboxError. A member alive but silent
fails the CPU's wait after `timeout`; on a GPU it stalls the worker (not handled
yet: the transport is chosen only by name, never by `auto`).
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import uuid
import weakref
from pathlib import Path

import torch

from basis.host_regions import pid_alive, remove_stale, shm_dir
from services.expert_parallel.mailbox import MailboxError
from services.expert_parallel.stream_flags import FlagError, StreamFlags
from services.expert_parallel.stream_stand_in import StandIn, Watchdog
from services.kv_transport.cuda_ipc import describe, pid_namespace

logger = logging.getLogger(__name__)
PREFIX = "yinian-stream-"
SLOTS = 2


def flag_index(member: int, slot: int, slots: int) -> tuple[int, int, int]:
    """(SENT, REPLIED, TAKEN) of a member's slot: SENT set by the worker's stream and
    reset by the member when it takes the dispatch (TAKEN keeps its value until the
    worker has the answer: what a stand-in serves again if the member died)."""
    base = 3 * (member * slots + slot)
    return base, base + 1, base + 2


def control_index(members: int, slots: int) -> dict[str, int]:
    """CLOSED, then each member's GONE and PID."""
    base = 3 * members * slots
    return {"closed": base, "gone": base + 1, "pid": base + 1 + members}


def flag_count(members: int, slots: int) -> int:
    return 3 * members * slots + 1 + 2 * members


def shared_tensor(path: Path, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over a /dev/shm file (the CPU's buffers): made by the worker, mapped
    by the member at the same path."""
    numel = 1
    for n in shape:
        numel *= n
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)


class _Dispatch:
    """One dispatch in flight: `wait()` gives the members' parts added up."""

    def __init__(self, port: StreamPort, slot: int, rows: int):
        self.port, self.slot, self.rows = port, slot, rows

    def done(self) -> bool:
        """Every member has answered (known on the CPU only: a GPU's stream waits)."""
        return self.port.answered(self)

    def wait(self) -> torch.Tensor:
        return self.port.combine(self)


class StreamPort:
    """One worker's buffers and flags for `members` expert services."""

    partial = True  # members answer with partial sums, not per-pair rows

    def __init__(self, members: int, dtype: torch.dtype, hidden: int, top_k: int,
                 device: torch.device, timeout: float, capacity: int,
                 slots: int = SLOTS):  # fmt: skip
        if members < 1 or capacity < 1 or slots < 1:
            raise ValueError("a stream port needs members, capacity and slots >= 1")
        self.members, self.dtype, self.hidden, self.top_k = members, dtype, hidden, top_k
        self.device, self.timeout, self.capacity, self.slots = device, timeout, capacity, slots
        self.control = control_index(members, slots)
        self.closed = False
        self.stand_ins: dict[int, StandIn] = {}  # lost members the worker answers for
        self._compute = self._lost = None
        self._guard = threading.Lock()
        self._busy = [False] * slots
        self._next = 0
        folder = shm_dir()
        remove_stale(folder, PREFIX)
        self.stem = folder / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._paths = [self.stem.with_suffix(".flags")]
        try:
            self.flags = StreamFlags(self._paths[0], flag_count(members, slots), device, True)
            self.flags.host[self.control["closed"]] = 0
            self.tokens = self._buffer("hidden", (slots, capacity, hidden), dtype)
            self.weights = self._buffer("weights", (slots, capacity, top_k), torch.float32)
            # every member's ids and partial sums in one tensor each: one copy in, one
            # sum out per dispatch, however many members
            self.ids = self._buffer("ids", (members, slots, capacity, top_k), torch.int32)
            self.out = self._buffer("out", (members, slots, capacity, hidden), dtype)
        except (OSError, RuntimeError) as exc:
            self.close()
            raise MailboxError(f"cannot make the expert stream buffers: {exc}") from exc
        weakref.finalize(self, _unlink, list(self._paths))

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        path = self.stem.with_suffix(f".{name}")
        self._paths.append(path)
        return shared_tensor(path, shape, dtype)

    def description(self, rank: int) -> bytes:
        m = rank - 1
        desc = {"version": 1, "kind": "stream", "flags": str(self._paths[0]),
                "members": self.members, "member": m, "slots": self.slots,
                "capacity": self.capacity, "hidden": self.hidden, "top_k": self.top_k,
                "dtype": str(self.dtype).removeprefix("torch."), "worker_pid": os.getpid(),
                "pidns": pid_namespace(), "cuda": None, "paths": None}  # fmt: skip
        tensors = {"hidden": self.tokens, "weights": self.weights, "ids": self.ids,
                   "out": self.out}  # fmt: skip
        if self.device.type == "cuda":
            desc["cuda"] = {k: describe([t]) for k, t in tensors.items()}
        else:
            desc["paths"] = {k: str(self.stem.with_suffix(f".{k}")) for k in tensors}
        return pickle.dumps(desc)

    def opened(self) -> None:
        """Every member has mapped its buffers: the names can go (the maps stay)."""
        _unlink(self._paths)

    @property
    def member_pids(self) -> list[int | None]:
        return [self.flags.host[self.control["pid"] + m] or None for m in range(self.members)]

    def begin_step(self) -> None:
        """Slots are taken in the same order every step (a captured step replays it)."""
        self._next = 0

    # -- the engine thread's side ----------------------------------------------
    def send(self, layer: int, tokens: torch.Tensor, weights: torch.Tensor,
             member_ids: torch.Tensor) -> _Dispatch:  # fmt: skip
        """Queues one dispatch: `tokens` [T, H], `weights` [T, k] and the members'
        expert ids [members, T, k] (-1: not that member's pair)."""
        if self.closed:
            raise MailboxError("the expert stream is closed")
        rows = tokens.shape[0]
        if rows > self.capacity:
            raise ValueError(f"{rows} tokens in one dispatch; the stream holds {self.capacity}")
        slot = self._next
        if self._busy[slot]:
            raise MailboxError(f"more than {self.slots} expert dispatches in flight")
        self._next = (slot + 1) % self.slots
        self._busy[slot] = True
        self.tokens[slot, :rows].copy_(tokens, non_blocking=True)
        self.weights[slot, :rows].copy_(weights, non_blocking=True)
        self.ids[:, slot, :rows].copy_(member_ids, non_blocking=True)
        for m in range(self.members):
            self.flags.write(flag_index(m, slot, self.slots)[0], (layer + 1) << 32 | rows)
        return _Dispatch(self, slot, rows)

    def combine(self, dispatch: _Dispatch) -> torch.Tensor:
        """The members' partial sums added up, [T, H]."""
        slot, rows = dispatch.slot, dispatch.rows
        try:
            for m in range(self.members):
                _, replied, taken = self.index(m, slot)
                self.flags.wait(replied, 1, lambda m=m: self._alive(m), self.timeout)
                self.flags.write(taken, 0)  # before REPLIED: a stand-in never sees it taken
                self.flags.write(replied, 0)  # and unanswered once it was answered
        except FlagError as exc:
            raise MailboxError(str(exc)) from exc
        finally:
            self._busy[slot] = False
        return self.out[:, slot, :rows].sum(dim=0)

    def index(self, member: int, slot: int) -> tuple[int, int, int]:
        return flag_index(member, slot, self.slots)

    def answered(self, dispatch: _Dispatch) -> bool:
        if self.device.type == "cuda":
            return False
        return all(self.flags.host[self.index(m, dispatch.slot)[1]] == 1
                   for m in range(self.members))  # fmt: skip

    # -- a member lost mid-step (services/expert_parallel/stream_stand_in.py) ----------
    def guard(self, compute, lost) -> None:
        """From now on a member found dead is answered for with `compute(layer,
        tokens, weights, ids)` (the worker's own experts), and `lost(member)` called
        once; a watchdog thread looks for dead members (a GPU's waits are the
        stream's: nothing else would see one)."""
        with self._guard:
            first = self._compute is None
            self._compute, self._lost = compute, lost
        if first:
            Watchdog(self).start()

    def dead(self, member: int) -> bool:
        host = self.flags.host
        pid = host[self.control["pid"] + member]
        return bool(host[self.control["gone"] + member]) or bool(pid and not pid_alive(pid))

    def lose(self, member: int) -> None:
        """Starts answering for `member` (once). The worker is told first (`lost`), so
        that no dispatch is answered by the stand-in before the worker knows."""
        with self._guard:
            if member in self.stand_ins or self._compute is None or self.closed:
                return
            stand_in = self.stand_ins[member] = StandIn(self, member, self._compute)
            lost = self._lost
        logger.warning("expert service %d of this stream group is gone: the worker answers "
                       "for it until a new group is formed", member + 1)  # fmt: skip
        lost(member)
        stand_in.start()

    def _alive(self, member: int) -> None:
        host = self.flags.host
        if self.closed or host[self.control["closed"]]:
            raise FlagError("the expert stream was closed")
        if member in self.stand_ins or not self.dead(member):
            return
        if self._compute is not None:
            self.lose(member)
            return
        if host[self.control["gone"] + member]:
            raise FlagError(f"expert service {member + 1} stopped serving this group")
        pid = host[self.control["pid"] + member]
        raise FlagError(f"expert service {member + 1} (pid {pid}) is gone")

    def leave(self) -> None:
        self.close()

    def close(self) -> None:
        """Ends the members' loops (they see CLOSED); from any thread."""
        if self.closed:
            return
        self.closed = True
        flags = getattr(self, "flags", None)
        if flags is not None:
            flags.host[self.control["closed"]] = 1
        _unlink(self._paths)


def _unlink(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)
