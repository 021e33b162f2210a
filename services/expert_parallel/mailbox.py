"""The data path between a worker and expert services on its host: shared
buffers, no collective and no socket (NCCL cannot put two ranks on one GPU;
gloo sends every row through TCP).

Per member the worker allocates, once per group, a ring of `SLOTS` slots, each
a payload buffer (rows in `wire.pack`'s format) and a reply buffer
([rows, hidden] in the worker's dtype): in host shared memory (a file under
/dev/shm) on the CPU, in the worker's GPU memory on the GPU, which the member
maps through CUDA IPC. A control block in the file carries the sequence
number of the last dispatch sent and of the last answered, each slot's
(kind, layer, rows), a closed flag and both ends' pids; two named pipes beside
it are doorbells (a byte after each publish), so a waiting end sleeps in
`select` and neither spins.

Ordering on the GPU: the worker writes a slot's payload on its stream, records
the slot's "sent" event (interprocess) and then publishes the sequence number;
the member's stream waits for that event, computes, writes the reply, records
the slot's "replied" event, and publishes. The worker's stream waits for that
event before it copies the reply out: neither host waits for its device. A
slot is written again only once its reply was taken (`_take`). A dispatch
with more rows for a member than a slot holds goes in several slots.

Ends: closing sets the flag (a graceful leave and an abort alike end the
member's loop); each end checks the other's pid every 0.2 s while it waits, and
the worker's waits end at the group's timeout, so a dead or hung member fails
the dispatch (`RemoteExperts` computes it locally) rather than the stream.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import pickle
import select
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from basis.host_regions import pid_alive, remove_stale, shm_dir
from services.expert_parallel.wire import KIND_ROWS, row_bytes
from services.kv_transport.cuda_ipc import PlainUnpickler, describe, open_remote, pid_namespace

PREFIX = "yinian-experts-"  # then <worker pid>-<random>-<rank>
SLOTS = 4  # dispatches (or pieces) in flight to one member
CAPACITY = 4096  # rows a slot holds
_SENT, _REPLIED, _CLOSED, _WORKER_PID, _MEMBER_PID = range(5)
_SLOT_BASE, _SLOT_FIELDS = 8, 3  # per slot: kind, layer, rows
_CONTROL_BYTES = 4096
_CHECK_EVERY = 0.2


class MailboxError(RuntimeError):
    """The shared path failed: the peer died, did not answer in time, or closed."""


def _doorbell(path: Path) -> int:
    with contextlib.suppress(FileExistsError):
        os.mkfifo(path, 0o600)
    return os.open(path, os.O_RDWR | os.O_NONBLOCK)  # never blocks, whoever opens first


def _ring(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):  # a full pipe wakes the reader all the same
        os.write(fd, b"\0")


def _sleep_on(fd: int, seconds: float) -> None:
    if select.select([fd], [], [], max(0.0, seconds))[0]:
        with contextlib.suppress(BlockingIOError):
            os.read(fd, 65536)


@dataclass
class _Shared:
    """One member's mailbox as either end maps it."""

    path: Path
    slots: int
    capacity: int
    row_width: int
    hidden: int
    dtype: torch.dtype
    file: mmap.mmap
    control: memoryview  # int64 fields
    payload: torch.Tensor  # [slots, capacity, row_width] uint8
    reply: torch.Tensor  # [slots, capacity, hidden]
    down: int  # the worker rings after a send
    up: int  # the member rings after a reply
    sent_events: list = field(default_factory=list)  # GPU: interprocess, one a slot
    replied_events: list = field(default_factory=list)

    def field(self, slot: int, i: int) -> int:
        return _SLOT_BASE + slot * _SLOT_FIELDS + i

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.down)
        with contextlib.suppress(OSError):
            os.close(self.up)


def _layout(slots: int, capacity: int, row_width: int, hidden: int, dtype) -> tuple[int, int]:
    payload = slots * capacity * row_width
    reply = slots * capacity * hidden * torch.empty((), dtype=dtype).element_size()
    return payload, reply


def _map(path: Path, size: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _views(m: mmap.mmap, slots, capacity, row_width, hidden, dtype, on_host: bool):
    control = memoryview(m)[:_CONTROL_BYTES].cast("q")
    if not on_host:
        return control, None, None
    payload_bytes, reply_bytes = _layout(slots, capacity, row_width, hidden, dtype)
    payload = torch.frombuffer(m, dtype=torch.uint8, count=payload_bytes, offset=_CONTROL_BYTES)
    reply = torch.frombuffer(m, dtype=torch.uint8, count=reply_bytes,
                             offset=_CONTROL_BYTES + payload_bytes)  # fmt: skip
    return (control, payload.view(slots, capacity, row_width),
            reply.view(dtype).view(slots, capacity, hidden))  # fmt: skip


class _Pending:
    """A dispatch in flight to the members: its pieces, and where their replies land."""

    def __init__(self, port: MailboxPort, result: torch.Tensor):
        self.port, self.result = port, result
        self.pieces: list[tuple[int, int]] = []  # (member, sequence number)

    def done(self) -> bool:
        return all(self.port.boxes[m].control[_REPLIED] >= seq for m, seq in self.pieces)

    def wait(self) -> torch.Tensor:
        for member, seq in self.pieces:
            self.port._take(member, seq)
        return self.result


class MailboxPort:
    """The worker's end (the `WorkerPort` calls): one mailbox per member, made here.
    `description(rank)` is what member `rank` needs to open its own."""

    def __init__(self, members: int, dtype: torch.dtype, hidden: int, device: torch.device,
                 timeout: float, capacity: int = CAPACITY, slots: int = SLOTS):  # fmt: skip
        if members < 1 or capacity < 1 or slots < 1:
            raise ValueError("a mailbox port needs members, capacity and slots >= 1")
        self.dtype, self.hidden, self.device, self.timeout = dtype, hidden, device, timeout
        self.row_width = row_bytes(dtype, hidden)
        self.on_host = device.type != "cuda"
        folder = shm_dir()
        remove_stale(folder, PREFIX)
        stem = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.boxes: list[_Shared] = []
        self.member_pids: list[int | None] = [None] * members
        self._seq = [0] * members
        self._taken = [0] * members  # replies taken, by sequence number (in order per member)
        self._owner: list[dict[int, tuple[_Pending, int, int]]] = [{} for _ in range(members)]
        self.closed = False
        try:
            for rank in range(1, members + 1):
                self.boxes.append(self._make(folder / f"{stem}-{rank}", capacity, slots))
        except BaseException:
            self.close()
            raise

    def _make(self, path: Path, capacity: int, slots: int) -> _Shared:
        payload_bytes, reply_bytes = _layout(slots, capacity, self.row_width, self.hidden,
                                             self.dtype)  # fmt: skip
        size = _CONTROL_BYTES + (payload_bytes + reply_bytes if self.on_host else 0)
        m = _map(path, size, create=True)
        control, payload, reply = _views(m, slots, capacity, self.row_width, self.hidden,
                                         self.dtype, self.on_host)  # fmt: skip
        control[_WORKER_PID] = os.getpid()
        box = _Shared(path, slots, capacity, self.row_width, self.hidden, self.dtype, m,
                      control, payload, reply, _doorbell(path.with_suffix(".down")),
                      _doorbell(path.with_suffix(".up")))  # fmt: skip
        if not self.on_host:
            box.payload = torch.empty(slots, capacity, self.row_width, dtype=torch.uint8,
                                      device=self.device)  # fmt: skip
            box.reply = torch.empty(slots, capacity, self.hidden, dtype=self.dtype,
                                    device=self.device)  # fmt: skip
            box.sent_events = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
            box.replied_events = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
            for event in box.sent_events + box.replied_events:
                event.record(torch.cuda.current_stream(self.device))  # a handle needs a record
        return box

    def description(self, rank: int) -> bytes:
        box = self.boxes[rank - 1]
        desc = {"version": 1, "path": str(box.path), "slots": box.slots,
                "capacity": box.capacity, "row_width": box.row_width, "hidden": box.hidden,
                "dtype": str(self.dtype).removeprefix("torch."), "worker_pid": os.getpid(),
                "pidns": pid_namespace(), "cuda": None}  # fmt: skip
        if not self.on_host:
            desc["cuda"] = {
                "payload": describe([box.payload]), "reply": describe([box.reply]),
                "sent": [bytes(e.ipc_handle()) for e in box.sent_events],
                "replied": [bytes(e.ipc_handle()) for e in box.replied_events],
            }  # fmt: skip
        return pickle.dumps(desc)

    def opened(self) -> None:
        """Every member has opened its mailbox: the names can go (the maps stay)."""
        for box in self.boxes:
            for path in (box.path, box.path.with_suffix(".down"), box.path.with_suffix(".up")):
                path.unlink(missing_ok=True)
        self.member_pids = [box.control[_MEMBER_PID] or None for box in self.boxes]

    # -- the engine thread's side (WorkerPort's calls) ---------------------------------
    def send(self, layer: int, rows_per_member: list[int], payload: torch.Tensor,
             dtype: torch.dtype, hidden: int) -> _Pending:  # fmt: skip
        if self.closed:
            raise MailboxError("the expert mailboxes are closed")
        result = torch.empty(sum(rows_per_member), hidden, dtype=dtype, device=self.device)
        pending = _Pending(self, result)
        offset = 0
        for member, rows in enumerate(rows_per_member):
            box = self.boxes[member]
            for start in range(0, rows, box.capacity):
                n = min(box.capacity, rows - start)
                self._put(member, layer, payload[offset + start : offset + start + n],
                          pending, offset + start)  # fmt: skip
            offset += rows
        return pending

    def _put(self, member: int, layer: int, rows: torch.Tensor, pending: _Pending,
             offset: int) -> None:  # fmt: skip
        box = self.boxes[member]
        seq = self._seq[member] + 1
        if seq - box.slots > self._taken[member]:  # the ring is full: free the oldest slot
            self._take(member, seq - box.slots)
        slot, n = seq % box.slots, rows.shape[0]
        box.payload[slot, :n].copy_(rows, non_blocking=True)
        if not self.on_host:
            box.sent_events[slot].record(torch.cuda.current_stream(self.device))
        box.control[box.field(slot, 0)] = KIND_ROWS
        box.control[box.field(slot, 1)] = layer
        box.control[box.field(slot, 2)] = n
        box.control[_SENT] = seq  # after the fields: the member reads them once it sees this
        self._seq[member] = seq
        self._owner[member][seq] = (pending, offset, n)
        pending.pieces.append((member, seq))
        _ring(box.down)

    def _take(self, member: int, seq: int) -> None:
        """Copies out every reply of `member` up to `seq` not taken yet (in order)."""
        box = self.boxes[member]
        while self._taken[member] < seq:
            nxt = self._taken[member] + 1
            self._await_reply(member, nxt)
            slot = nxt % box.slots
            pending, offset, n = self._owner[member].pop(nxt)
            if not self.on_host:
                torch.cuda.current_stream(self.device).wait_event(box.replied_events[slot])
            pending.result[offset : offset + n].copy_(box.reply[slot, :n], non_blocking=True)
            self._taken[member] = nxt

    def _await_reply(self, member: int, seq: int) -> None:
        box = self.boxes[member]
        deadline = time.monotonic() + self.timeout
        while box.control[_REPLIED] < seq:
            if self.closed or box.control[_CLOSED]:
                raise MailboxError("the expert mailboxes were closed")
            now = time.monotonic()
            if now > deadline:
                raise MailboxError(f"expert service {member + 1} did not answer in "
                                   f"{self.timeout:.1f} s")  # fmt: skip
            pid = box.control[_MEMBER_PID]
            if pid and not pid_alive(pid):
                raise MailboxError(f"expert service {member + 1} (pid {pid}) is gone")
            _sleep_on(box.up, min(_CHECK_EVERY, deadline - now))

    def leave(self) -> None:
        self.close()

    def close(self) -> None:
        """Ends every member's loop (graceful or not: a member only serves)."""
        if self.closed:
            return
        self.closed = True
        for box in self.boxes:
            box.control[_CLOSED] = 1
            _ring(box.down)
        self.opened()  # the names, if still there
        for box in self.boxes:
            box.close()


class MemberMailbox:
    """A member's end (the `MemberPort` calls), opened from the worker's
    description; raises MailboxError where this process cannot map it (another
    host, another IPC namespace, a GPU it cannot see)."""

    def __init__(self, description: bytes, device: torch.device):
        try:
            desc = PlainUnpickler(io.BytesIO(description)).load()
            self._open(desc, device)
        except MailboxError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever stops the mapping
            raise MailboxError(f"cannot open the worker's expert mailbox: {exc}") from exc

    def _open(self, desc: dict, device: torch.device) -> None:
        if desc.get("version") != 1:
            raise MailboxError(f"mailbox version {desc.get('version')} is not 1")
        dtype = getattr(torch, desc["dtype"])
        on_host = desc["cuda"] is None
        if on_host == (device.type == "cuda"):
            raise MailboxError(f"the worker's activations are on the {'CPU' if on_host else 'GPU'}"
                               f", this service's experts on {device}")  # fmt: skip
        path = Path(desc["path"])
        slots, capacity = desc["slots"], desc["capacity"]
        row_width, hidden = desc["row_width"], desc["hidden"]
        payload_bytes, reply_bytes = _layout(slots, capacity, row_width, hidden, dtype)
        size = _CONTROL_BYTES + (payload_bytes + reply_bytes if on_host else 0)
        m = _map(path, size, create=False)
        control, payload, reply = _views(m, slots, capacity, row_width, hidden, dtype, on_host)
        box = _Shared(path, slots, capacity, row_width, hidden, dtype, m, control, payload,
                      reply, _doorbell(path.with_suffix(".down")),
                      _doorbell(path.with_suffix(".up")))  # fmt: skip
        self.device, self.box = device, box
        if not on_host:
            cuda = desc["cuda"]
            box.payload = open_remote(cuda["payload"])[0]
            box.reply = open_remote(cuda["reply"])[0]
            index = box.payload.device
            box.sent_events = [torch.cuda.Event.from_ipc_handle(index, h) for h in cuda["sent"]]
            box.replied_events = [
                torch.cuda.Event.from_ipc_handle(index, h) for h in cuda["replied"]
            ]
        same_pids = desc["pidns"] == pid_namespace()
        self.worker_pid = desc["worker_pid"] if same_pids else None
        control[_MEMBER_PID] = os.getpid() if same_pids else 0
        self._seen = control[_REPLIED]  # a fresh mailbox: 0
        self._slot = self._rows = None

    def receive(self) -> tuple[int, torch.Tensor] | None:
        """(layer, payload [rows, row_width] uint8), or None once the worker left."""
        box, seq = self.box, self._seen + 1
        while box.control[_SENT] < seq:
            if box.control[_CLOSED]:
                return None
            if self.worker_pid is not None and not pid_alive(self.worker_pid):
                return None  # the worker is gone: nothing more will come
            _sleep_on(box.down, _CHECK_EVERY)
        slot = seq % box.slots
        kind, layer, rows = (box.control[box.field(slot, i)] for i in range(3))
        if kind != KIND_ROWS:
            raise MailboxError(f"unknown dispatch kind {kind} from the worker")
        payload = box.payload[slot, :rows]
        if box.sent_events:
            torch.cuda.current_stream(self.device).wait_event(box.sent_events[slot])
            payload = payload.to(self.device)  # a copy only where the GPUs differ
        self._seen, self._slot, self._rows = seq, slot, rows
        return layer, payload

    def reply(self, outputs: torch.Tensor) -> None:
        """The outputs of the last received rows, in their order."""
        box, slot = self.box, self._slot
        if slot is None or outputs.shape[0] != self._rows:
            raise MailboxError(f"{outputs.shape[0]} outputs for {self._rows} rows")
        box.reply[slot, : self._rows].copy_(outputs, non_blocking=True)
        if box.replied_events:
            box.replied_events[slot].record(torch.cuda.current_stream(self.device))
        box.control[_REPLIED] = self._seen
        self._slot = None
        _ring(box.up)

    def close(self) -> None:
        self.box.close()
