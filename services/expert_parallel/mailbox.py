"""The data path between a worker and expert services on its host: shared
buffers, no collective and no socket (NCCL cannot put two ranks on one GPU;
gloo sends every row through TCP).

Per member the worker allocates, once per group, a ring of `SLOTS` slots, each
the rows ([rows, hidden] in the worker's dtype), their expert ids and the reply
([rows, hidden]), laid out as each end computes on them (no packing): in host
shared memory (a file under /dev/shm) on the CPU, in the worker's GPU memory on
the GPU, which the member maps through CUDA IPC (mailbox_member.py is its end).
A control block in the file carries the sequence number of the last dispatch
sent and of the last answered, each slot's (kind, layer, rows), closed and gone
flags and both ends' pids; two named pipes beside it are doorbells (a byte after
each publish), so a waiting end sleeps in `poll`; on a GPU host it first polls
the control block for up to SPIN_GPU seconds.

Ordering on the GPU: the worker writes a slot's rows and ids on its stream, records
the slot's "sent" event (interprocess) and then publishes the sequence number;
the member's stream waits for that event, computes, writes the reply, records
the slot's "replied" event, and publishes. The worker's stream waits for that
event before it copies the reply out: neither host waits for its device (the
row counts a dispatch sends are on the host already). A slot is written again
only once its reply was taken (`_take`). A dispatch with more rows for a
member than a slot holds goes in several slots. The ordering of the control
fields relies on x86's store order (no fences from Python).

Ends: closing sets the closed flag (a graceful leave and an abort alike end the
member's loop); a member whose loop ends sets its gone flag. Each end checks
the other's flags and pid at every wake and every 0.2 s, and the worker's waits
end at the group's timeout, so a dead, failed or hung member fails the dispatch
(`RemoteExperts` computes it locally) rather than the stream. Only the thread
that waits on a doorbell closes it, when its object is collected; a closed
port whose members have not yet let go is kept (its GPU buffers and events)
until they do.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import select
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from basis.host_regions import pid_alive, remove_stale, shm_dir
from services.expert_parallel.wire import KIND_ROWS
from services.kv_transport.cuda_ipc import describe, pid_namespace

PREFIX = "yinian-experts-"  # then <worker pid>-<random>-<rank>
SLOTS = 4  # dispatches (or pieces) in flight to one member
CAPACITY = 4096  # rows a slot holds
SENT, REPLIED, CLOSED, WORKER_PID, MEMBER_PID, GONE = range(6)
_SLOT_BASE, _SLOT_FIELDS = 8, 3  # per slot: kind, layer, rows
CONTROL_BYTES = 4096
CHECK_EVERY = 0.2
# Seconds an end polls the control block before it sleeps on its doorbell: on a GPU
# host a process woken through a pipe loses tens of microseconds each way, a layer's
# whole expert time at decode; on the CPU the cores are the compute's (0: no spin).
SPIN_GPU = 0.002
_retired: list[MailboxPort] = []  # closed, a member still mapping them


class MailboxError(RuntimeError):
    """The shared path failed: the peer died, did not answer in time, or closed."""


def doorbell(path: Path) -> int:
    with contextlib.suppress(FileExistsError):
        os.mkfifo(path, 0o600)
    return os.open(path, os.O_RDWR | os.O_NONBLOCK)  # never blocks, whoever opens first


def ring(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):  # a full pipe wakes the reader all the same
        os.write(fd, b"\0")


def sleep_on(fd: int, seconds: float) -> None:
    waiter = select.poll()
    waiter.register(fd, select.POLLIN)
    if waiter.poll(max(0.0, seconds) * 1e3):
        with contextlib.suppress(BlockingIOError):
            os.read(fd, 65536)


def spin_until(control: memoryview, index: int, target: int, seconds: float) -> bool:
    """Polls `control[index] >= target` for up to `seconds` (the GIL released between
    looks, so the process's other threads run); whether it got there. Each look
    yields the core (~0.5 us) where `time.sleep(0)` would sleep out the kernel's
    timer slack (~50-75 us: on an H100 that made a dispatch ~200 us, not ~30)."""
    if seconds <= 0:
        return control[index] >= target
    end = time.perf_counter() + seconds
    while control[index] < target:
        if control[CLOSED] or control[GONE] or time.perf_counter() > end:
            return False
        os.sched_yield()  # not time.sleep(0): a zero sleep still waits out the timer slack
    return True


def default_spin(device: torch.device, spin: float | None) -> float:
    """`spin`, or SPIN_GPU on a GPU and none on the CPU when it is None."""
    if spin is not None:
        return spin
    return SPIN_GPU if device.type == "cuda" else 0.0


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


@dataclass
class Shared:
    """One member's mailbox as either end maps it."""

    path: Path
    slots: int
    capacity: int
    file: mmap.mmap
    control: memoryview  # int64 fields
    rows: torch.Tensor | None = None  # [slots, capacity, hidden]
    ids: torch.Tensor | None = None  # [slots, capacity] int64
    reply: torch.Tensor | None = None  # [slots, capacity, hidden]
    fds: list[int] = field(default_factory=list)  # doorbells: down (to the member), up
    sent_events: list = field(default_factory=list)  # GPU: interprocess, one a slot
    replied_events: list = field(default_factory=list)

    @property
    def down(self) -> int:
        return self.fds[0]

    @property
    def up(self) -> int:
        return self.fds[1]

    def slot_field(self, slot: int, i: int) -> int:
        return _SLOT_BASE + slot * _SLOT_FIELDS + i

    def open_doorbells(self) -> None:
        for suffix in (".down", ".up"):
            self.fds.append(doorbell(self.path.with_suffix(suffix)))


def layout(slots: int, capacity: int, hidden: int, dtype) -> tuple[int, int, int]:
    """Bytes of the rows, the ids and the replies of every slot, each region rounded up
    to 64 (the next one starts aligned for any element type)."""
    rows = slots * capacity * hidden * torch.empty((), dtype=dtype).element_size()
    return tuple(-(-size // 64) * 64 for size in (rows, slots * capacity * 8, rows))


def map_file(path: Path, size: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:  # the pages now: a full /dev/shm is an error here, not a SIGBUS later
            os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def file_bytes(slots: int, capacity: int, hidden: int, dtype, on_host: bool) -> int:
    return CONTROL_BYTES + (sum(layout(slots, capacity, hidden, dtype)) if on_host else 0)


def host_views(box: Shared, hidden: int, dtype) -> None:
    """The rings of rows, ids and replies inside the file (the CPU's mailboxes)."""
    offset, views = CONTROL_BYTES, []
    regions = zip(layout(box.slots, box.capacity, hidden, dtype), (dtype, torch.int64, dtype),
                  (hidden, 1, hidden))  # fmt: skip
    for size, kind, width in regions:
        count = box.slots * box.capacity * width
        raw = torch.frombuffer(box.file, dtype=kind, count=count, offset=offset)
        views.append(raw.view(box.slots, box.capacity, width))
        offset += size
    box.rows, box.ids, box.reply = views[0], views[1][..., 0], views[2]


class _Pending:
    """A dispatch in flight to the members: its pieces, and where their replies land."""

    def __init__(self, port: MailboxPort, result: torch.Tensor):
        self.port, self.result = port, result
        self.pieces: list[tuple[int, int]] = []  # (member, sequence number)

    def done(self) -> bool:
        return all(self.port.boxes[m].control[REPLIED] >= seq for m, seq in self.pieces)

    def wait(self) -> torch.Tensor:
        deadline = time.monotonic() + self.port.timeout  # for the whole dispatch
        for member, seq in self.pieces:
            self.port._take(member, seq, deadline)
        return self.result


class MailboxPort:
    """The worker's end (the `WorkerPort` calls): one mailbox per member, made here.
    `description(rank)` is what member `rank` needs to open its own. A file or
    memory that cannot be made is a MailboxError. `spin`: seconds a wait for a reply
    polls before it sleeps (default SPIN_GPU on a GPU, none on the CPU)."""

    def __init__(self, members: int, dtype: torch.dtype, hidden: int, device: torch.device,
                 timeout: float, capacity: int = CAPACITY, slots: int = SLOTS,
                 spin: float | None = None):  # fmt: skip
        if members < 1 or capacity < 1 or slots < 1:
            raise ValueError("a mailbox port needs members, capacity and slots >= 1")
        _retired[:] = [p for p in _retired if p.held()]
        self.dtype, self.hidden, self.device, self.timeout = dtype, hidden, device, timeout
        self.spin = default_spin(device, spin)
        self.on_host = device.type != "cuda"
        self.boxes: list[Shared] = []
        self._fds: list[int] = []
        weakref.finalize(self, _close_fds, self._fds)  # once no thread can be waiting on them
        self._seq = [0] * members
        self._taken = [0] * members  # replies taken, by sequence number (in order per member)
        self._owner: list[dict[int, tuple[_Pending, int, int]]] = [{} for _ in range(members)]
        self.closed = False
        try:
            folder = shm_dir()
            remove_stale(folder, PREFIX)
            stem = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
            for rank in range(1, members + 1):
                self.boxes.append(self._make(folder / f"{stem}-{rank}", capacity, slots))
        except (OSError, RuntimeError) as exc:  # no room in /dev/shm or on the GPU
            self.close()
            raise MailboxError(f"cannot make the expert mailboxes: {exc}") from exc

    def _make(self, path: Path, capacity: int, slots: int) -> Shared:
        m = map_file(path, file_bytes(slots, capacity, self.hidden, self.dtype, self.on_host),
                     create=True)  # fmt: skip
        box = Shared(path, slots, capacity, m, memoryview(m)[:CONTROL_BYTES].cast("q"))
        try:
            box.open_doorbells()
        finally:
            self._fds.extend(box.fds)  # closed with the port, even where one failed to open
        box.control[WORKER_PID] = os.getpid()
        if self.on_host:
            host_views(box, self.hidden, self.dtype)
            return box
        box.rows, box.reply = (torch.empty(slots, capacity, self.hidden, dtype=self.dtype,
                                           device=self.device) for _ in range(2))  # fmt: skip
        box.ids = torch.empty(slots, capacity, dtype=torch.int64, device=self.device)
        box.sent_events = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
        box.replied_events = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
        for event in box.sent_events + box.replied_events:
            event.record(torch.cuda.current_stream(self.device))  # a handle needs a record
        return box

    def description(self, rank: int) -> bytes:
        box = self.boxes[rank - 1]
        desc = {"version": 1, "path": str(box.path), "slots": box.slots,
                "capacity": box.capacity, "hidden": self.hidden,
                "dtype": str(self.dtype).removeprefix("torch."), "worker_pid": os.getpid(),
                "pidns": pid_namespace(), "cuda": None}  # fmt: skip
        if not self.on_host:
            desc["cuda"] = {
                "rows": describe([box.rows]), "ids": describe([box.ids]),
                "reply": describe([box.reply]),
                "sent": [bytes(e.ipc_handle()) for e in box.sent_events],
                "replied": [bytes(e.ipc_handle()) for e in box.replied_events],
            }  # fmt: skip
        return pickle.dumps(desc)

    def opened(self) -> None:
        """Every member has opened its mailbox: the names can go (the maps stay)."""
        for box in self.boxes:
            for path in (box.path, box.path.with_suffix(".down"), box.path.with_suffix(".up")):
                path.unlink(missing_ok=True)

    @property
    def member_pids(self) -> list[int | None]:
        return [box.control[MEMBER_PID] or None for box in self.boxes]

    # -- the engine thread's side (WorkerPort's calls) ---------------------------------
    def send(self, layer: int, rows_per_member: list[int], rows: torch.Tensor,
             expert_ids: torch.Tensor) -> _Pending:  # fmt: skip
        """Each member's rows (grouped by member in rank order) and their expert ids."""
        if self.closed:
            raise MailboxError("the expert mailboxes are closed")
        result = torch.empty(sum(rows_per_member), self.hidden, dtype=self.dtype,
                             device=self.device)  # fmt: skip
        pending = _Pending(self, result)
        offset = 0
        for member, count in enumerate(rows_per_member):
            box = self.boxes[member]
            for start in range(0, count, box.capacity):
                n = min(box.capacity, count - start)
                at = offset + start
                self._put(member, layer, rows[at : at + n], expert_ids[at : at + n], pending, at)
            offset += count
        return pending

    def _put(self, member: int, layer: int, rows: torch.Tensor, ids: torch.Tensor,
             pending: _Pending, offset: int) -> None:  # fmt: skip
        box = self.boxes[member]
        seq = self._seq[member] + 1
        if seq - box.slots > self._taken[member]:  # the ring is full: free the oldest slot
            self._take(member, seq - box.slots, time.monotonic() + self.timeout)
        slot, n = seq % box.slots, rows.shape[0]
        box.rows[slot, :n].copy_(rows, non_blocking=True)
        box.ids[slot, :n].copy_(ids, non_blocking=True)
        if not self.on_host:
            box.sent_events[slot].record(torch.cuda.current_stream(self.device))
        box.control[box.slot_field(slot, 0)] = KIND_ROWS
        box.control[box.slot_field(slot, 1)] = layer
        box.control[box.slot_field(slot, 2)] = n
        box.control[SENT] = seq  # after the fields: the member reads them once it sees this
        self._seq[member] = seq
        self._owner[member][seq] = (pending, offset, n)
        pending.pieces.append((member, seq))
        ring(box.down)

    def _take(self, member: int, seq: int, deadline: float) -> None:
        """Copies out every reply of `member` up to `seq` not taken yet (in order)."""
        box = self.boxes[member]
        while self._taken[member] < seq:
            nxt = self._taken[member] + 1
            self._await_reply(member, nxt, deadline)
            slot = nxt % box.slots
            pending, offset, n = self._owner[member].pop(nxt)
            if not self.on_host:
                torch.cuda.current_stream(self.device).wait_event(box.replied_events[slot])
            pending.result[offset : offset + n].copy_(box.reply[slot, :n], non_blocking=True)
            self._taken[member] = nxt

    def _await_reply(self, member: int, seq: int, deadline: float) -> None:
        box = self.boxes[member]
        if spin_until(box.control, REPLIED, seq, self.spin):
            return
        while box.control[REPLIED] < seq:
            if self.closed or box.control[CLOSED]:
                raise MailboxError("the expert mailboxes were closed")
            if box.control[GONE]:
                raise MailboxError(f"expert service {member + 1} stopped serving this group")
            pid = box.control[MEMBER_PID]
            if pid and not pid_alive(pid):
                raise MailboxError(f"expert service {member + 1} (pid {pid}) is gone")
            now = time.monotonic()
            if now > deadline:
                raise MailboxError(f"expert service {member + 1} did not answer in "
                                   f"{self.timeout:.1f} s")  # fmt: skip
            sleep_on(box.up, min(CHECK_EVERY, deadline - now))

    def leave(self) -> None:
        self.close()

    def close(self) -> None:
        """Ends every member's loop (graceful or not: a member only serves), and any
        wait of the engine thread's; from any thread."""
        if self.closed:
            return
        self.closed = True
        for box in self.boxes:
            box.control[CLOSED] = 1
            ring(box.down)
            ring(box.up)
        self.opened()  # the names, if still there
        if not self.on_host and self.held():
            _retired.append(self)  # its GPU buffers and events outlive the members' use

    def held(self) -> bool:
        """A member may still touch this port's memory (not gone, its process alive)."""
        return any(
            box.control[MEMBER_PID] and not box.control[GONE]
            and pid_alive(box.control[MEMBER_PID]) for box in self.boxes
        )  # fmt: skip
