"""An expert service's end of a worker's mailbox (services/expert_parallel/
mailbox.py): opened from the description the worker sent in Join, then the
`MemberPort` calls, receive and reply, on the thread that serves the group."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import torch

from basis.host_regions import pid_alive
from services.expert_parallel.mailbox import (
    CHECK_EVERY,
    CLOSED,
    CONTROL_BYTES,
    GONE,
    MEMBER_PID,
    REPLIED,
    SENT,
    MailboxError,
    Shared,
    default_spin,
    file_bytes,
    host_views,
    map_file,
    ring,
    sleep_on,
    spin_until,
)
from services.expert_parallel.wire import KIND_ROWS
from services.kv_transport.cuda_ipc import PlainUnpickler, open_remote, pid_namespace


def member_device(device: torch.device, on_gpu: bool) -> torch.device:
    """This service's device for a worker's buffers on its GPU (`on_gpu`) or host: a
    MailboxError where they are not on the same kind; "cuda" names this process's
    current GPU."""
    if on_gpu != (device.type == "cuda"):
        raise MailboxError(f"the worker's activations are on the {'GPU' if on_gpu else 'CPU'}"
                           f", this service's experts on {device}")  # fmt: skip
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_mapped(mapped: torch.Tensor, device: torch.device) -> None:
    """The worker's GPU buffers must be on this service's GPU (the flags and events
    of each end are its own GPU's)."""
    if mapped.device != device:
        raise MailboxError(f"the worker's activations are on {mapped.device}, "
                           f"this service's experts on {device}")  # fmt: skip


def worker_pid(desc: dict) -> int | None:
    """The worker's pid where this process sees the same pids (a death it can notice)."""
    return desc["worker_pid"] if desc["pidns"] == pid_namespace() else None


class MemberMailbox:
    """Raises MailboxError where this process cannot map the mailbox (another host,
    another IPC namespace, a GPU it cannot see or that is not its own)."""

    def __init__(self, description: bytes, device: torch.device, spin: float | None = None):
        """`spin`: seconds `receive` polls before it sleeps (default SPIN_GPU on a
        GPU, none on the CPU): the next layer's rows come soon after a reply."""
        self.spin = default_spin(device, spin)
        self.box: Shared | None = None
        self._stopping = False
        try:
            desc = PlainUnpickler(io.BytesIO(description)).load()
            self._open(desc, device)
        except Exception as exc:  # noqa: BLE001 - whatever stops the mapping
            self.close()
            if isinstance(exc, MailboxError):
                raise
            raise MailboxError(f"cannot open the worker's expert mailbox: {exc}") from exc

    def _open(self, desc: dict, device: torch.device) -> None:
        if desc.get("version") != 1:
            raise MailboxError(f"mailbox version {desc.get('version')} is not 1")
        dtype = getattr(torch, desc["dtype"])
        on_host = desc["cuda"] is None
        device = member_device(device, not on_host)
        slots, capacity, hidden = desc["slots"], desc["capacity"], desc["hidden"]
        path = Path(desc["path"])
        m = map_file(path, file_bytes(slots, capacity, hidden, dtype, on_host), create=False)
        box = Shared(path, slots, capacity, m, memoryview(m)[:CONTROL_BYTES].cast("q"))
        self.box, self.device = box, device
        box.open_doorbells()
        if on_host:
            host_views(box, hidden, dtype)
        else:
            cuda = desc["cuda"]
            box.rows, box.ids, box.reply = (
                open_remote(cuda[k])[0] for k in ("rows", "ids", "reply")
            )
            check_mapped(box.rows, device)
            box.sent_events = [torch.cuda.Event.from_ipc_handle(device, h) for h in cuda["sent"]]
            box.replied_events = [
                torch.cuda.Event.from_ipc_handle(device, h) for h in cuda["replied"]
            ]
        self.worker_pid = worker_pid(desc)
        box.control[MEMBER_PID] = os.getpid() if self.worker_pid is not None else 0
        self._seen = box.control[REPLIED]  # a fresh mailbox: 0
        self._slot = self._rows = None

    def receive(self) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """(layer, rows [n, hidden], their expert ids [n]): views of the slot, valid
        until `reply`; or None once the worker left, closed the group, or `stop()`
        was called."""
        box, seq = self.box, self._seen + 1
        spin_until(box.control, SENT, seq, self.spin)
        while box.control[SENT] < seq:
            if box.control[CLOSED] or self._stopping:
                return None
            if self.worker_pid is not None and not pid_alive(self.worker_pid):
                return None  # the worker is gone: nothing more will come
            sleep_on(box.down, CHECK_EVERY)
        if box.control[CLOSED] or self._stopping:
            return None
        slot = seq % box.slots
        kind, layer, rows = (box.control[box.slot_field(slot, i)] for i in range(3))
        if kind != KIND_ROWS:
            raise MailboxError(f"unknown dispatch kind {kind} from the worker")
        if box.sent_events:
            torch.cuda.current_stream(self.device).wait_event(box.sent_events[slot])
        self._seen, self._slot, self._rows = seq, slot, rows
        return layer, box.rows[slot, :rows], box.ids[slot, :rows]

    def reply(self, outputs: torch.Tensor) -> None:
        """The outputs of the last received rows, in their order."""
        box, slot = self.box, self._slot
        if slot is None or outputs.shape[0] != self._rows:
            raise MailboxError(f"{outputs.shape[0]} outputs for {self._rows} rows")
        box.reply[slot, : self._rows].copy_(outputs, non_blocking=True)
        if box.replied_events:
            box.replied_events[slot].record(torch.cuda.current_stream(self.device))
        box.control[REPLIED] = self._seen
        self._slot = None
        ring(box.up)

    def stop(self) -> None:
        """Ends the serving loop from another thread (its next wake)."""
        self._stopping = True
        box = self.box
        if box is not None and box.fds:
            with contextlib.suppress(OSError):  # the thread closed it meanwhile
                ring(box.down)

    def close(self) -> None:
        """The serving thread's last word: gone (the worker stops waiting on this
        member at once), then the doorbells closed."""
        box, self.box = self.box, None
        if box is None:
            return
        box.control[GONE] = 1
        if box.fds:
            ring(box.up)
        for fd in box.fds:
            os.close(fd)
