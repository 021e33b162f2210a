"""What both ends of the nccl KV transport share: the 2-rank process groups
built outside the default group, store clients, completion of NCCL work
against a deadline, and thread bookkeeping."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

FOREVER = timedelta(days=365)
MESSAGE_BYTES = 256 << 20  # most bytes in one message (unless one layer is larger)


def done_event(work, stream: torch.cuda.Stream) -> torch.cuda.Event:
    """An event on `stream` that completes with the NCCL op (the host does not block)."""
    with torch.cuda.stream(stream):
        work.wait()  # without a timeout: only makes the current stream wait for the op
        event = torch.cuda.Event()
        event.record(stream)
    return event


def poll_event(event: torch.cuda.Event, timeout: float, what: str, store=None) -> None:
    """Waits for `event`; raises after `timeout`, or as soon as `store` (the peer's
    TCPStore, checked every 0.2 s) is unreachable: the peer process is gone and the
    op would only end at the timeout. The 20 us sleeps release the GIL."""
    start = time.monotonic()
    deadline, next_check = start + timeout, start + 0.2
    while not event.query():
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"{what} not done in {timeout:.0f} s")
        if store is not None and now > next_check:
            next_check = now + 0.2
            try:
                store.check(["alive"])
            except Exception as e:
                raise ConnectionError(f"{what}: peer unreachable ({e!r})") from e
        time.sleep(2e-5)


def check_work(work, timeout: float) -> None:
    """Raises if a finished op failed: an aborted communicator also ends its kernels,
    so the op's event completes either way."""
    work.wait(timedelta(seconds=timeout))  # returns at once for a finished op, or raises


def complete(work, tensor: torch.Tensor, timeout: float, what: str) -> None:
    """Blocks until the op is done, or raises after `timeout` seconds or if it failed."""
    if tensor.is_cuda:
        poll_event(done_event(work, torch.cuda.current_stream(tensor.device)), timeout, what)
    check_work(work, timeout)


def make_group(backend: str, store, rank: int, timeout: float, host: str, world: int = 2):
    """A `world`-rank backend object on `store`, outside the default process group
    (2 ranks for a KV handoff; a worker and its expert services for MoE)."""
    td = timedelta(seconds=timeout)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = td
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, world, opts)
    opts = dist.ProcessGroupNCCL.Options()
    # Past our own deadlines, so a stuck op is reported by poll_event, and the
    # watchdog's abort (which lets the op's event complete) comes later.
    opts._timeout = td + timedelta(seconds=5)
    # The default (3) kills the process when an op times out; 2 only aborts the
    # communicator, so our wait() raises instead. Read at construction only.
    var, old = "TORCH_NCCL_ASYNC_ERROR_HANDLING", os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    os.environ[var] = "2"
    try:
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    finally:
        os.environ.pop(var) if old is None else os.environ.__setitem__(var, old)


def start_thread(threads: list, target, *args) -> None:
    thread = threading.Thread(target=target, args=args, daemon=True)
    threads[:] = [t for t in threads if t.is_alive()] + [thread]
    thread.start()


def join_threads(threads: list, timeout: float) -> None:
    # Threads still inside c10d calls when the interpreter exits abort the process.
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


def abort_group(pg) -> None:
    for name in ("abort", "shutdown"):
        with contextlib.suppress(Exception):
            getattr(pg, name)()
            return


def store_client(host: str, port: int, timeout: float) -> dist.TCPStore:
    # One connection per blocking user: a TCPStore client runs one op at a time.
    return dist.TCPStore(
        host, port, None, False, timedelta(seconds=timeout), wait_for_workers=False
    )


def local_address(host: str, port: int) -> str:
    """The address this host reaches `host` from (gloo binds to it); "" = gloo's default."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # sends nothing
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return ""
