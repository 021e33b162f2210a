"""An expert service's data path: one thread per worker group it joined, each
receiving that worker's dispatches, computing them and answering, until the
worker leaves or the group breaks (a peer died, the worker aborted it). A
group is a collective one (gloo/NCCL), the worker's mailbox on this host, or its
stream-ordered buffers (every token, answered with this service's part)."""

from __future__ import annotations

import logging
import threading
import time

import torch

from services.common.errors import FailedPrecondition
from services.expert.expert_store import ExpertStore
from services.expert.partial_graphs import PartialGraphs
from services.expert_parallel import metrics
from services.expert_parallel.mailbox import MailboxError
from services.expert_parallel.mailbox_member import MemberMailbox
from services.expert_parallel.stream_member import StreamMember
from services.expert_parallel.wire import MemberPort
from services.kv_transport.nccl_group import (
    FOREVER,
    abort_group,
    make_group,
    store_client,
)

logger = logging.getLogger(__name__)
BACKENDS = ("gloo", "nccl", "shared", "stream")
MAPPED = ("shared", "stream")  # the worker's buffers, mapped in Join


class GroupServer:
    def __init__(self, store: ExpertStore, expert_id: str, host: str, model: str,
                 hidden_size: int):  # fmt: skip
        self.store, self.expert_id, self.host = store, expert_id, host
        self.model, self.hidden_size = model, hidden_size
        self._threads: dict[str, threading.Thread] = {}
        self._groups: dict[str, object] = {}  # group id -> what stops it, while served
        self._lock = threading.Lock()

    @property
    def dtype_name(self) -> str:
        return str(self.store.dtype).removeprefix("torch.")

    def check(self, request) -> None:
        """Everything a Join must agree on; a ValueError before any thread starts."""
        if request.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {request.backend!r}")
        if request.world_size < 2 or not 1 <= request.rank < request.world_size:
            raise ValueError(f"rank {request.rank} does not fit a group of {request.world_size}")
        if request.dtype != self.dtype_name:
            raise ValueError(f"the worker computes in {request.dtype}, this service in "
                             f"{self.dtype_name}")  # fmt: skip
        if request.hidden_size != self.hidden_size:
            raise ValueError(f"hidden size {request.hidden_size} != {self.hidden_size}")
        if request.model and self.model and request.model != self.model:
            raise ValueError(f"the worker serves {request.model}, this service {self.model}")
        if request.backend in MAPPED:
            if not request.mailbox:
                raise ValueError(f"a {request.backend} Join needs the worker's buffers")
        elif not request.store_host or not request.store_port:
            raise ValueError("a Join needs the rendezvous store's host and port")

    def join(self, request) -> None:
        """Starts serving the group; a mailbox is mapped here, so a worker on another
        host (or GPU this process cannot see) learns at once (FailedPrecondition)."""
        self.check(request)
        mailbox = None
        if request.backend in MAPPED:
            opener = MemberMailbox if request.backend == "shared" else StreamMember
            try:
                mailbox = opener(request.mailbox, self.store.device)
            except MailboxError as exc:
                raise FailedPrecondition(str(exc)) from exc
        thread = threading.Thread(target=self._serve, args=(request, mailbox), daemon=True,
                                  name=f"expert-group-{request.group_id}")  # fmt: skip
        with self._lock:
            self._threads = {k: t for k, t in self._threads.items() if t.is_alive()}
            self._threads[request.group_id] = thread
        thread.start()

    @property
    def num_groups(self) -> int:
        with self._lock:
            return sum(t.is_alive() for t in self._threads.values())

    def _connect(self, request):
        """(the port, what stops it from another thread, what ends it) of a collective
        group: joins its rendezvous."""
        client = store_client(request.store_host, request.store_port,
                              request.timeout_seconds or 30.0)  # fmt: skip
        # A member waits as long as the worker is idle; a dead peer ends the
        # wait at once (its connections close), not a timeout.
        pg = make_group(request.backend, client, request.rank, FOREVER.total_seconds(),
                        self.host, request.world_size)  # fmt: skip
        port = MemberPort(pg, request.world_size, request.rank, self.store.device,
                          self.store.dtype, self.hidden_size)  # fmt: skip
        return port, lambda: abort_group(pg), lambda: abort_group(pg)

    def _serve(self, request, mailbox: MemberMailbox | StreamMember | None) -> None:
        if mailbox is not None:  # only this thread closes it (its doorbells)
            port, stop, end = mailbox, mailbox.stop, mailbox.close
        else:
            try:
                port, stop, end = self._connect(request)
            except Exception as exc:
                logger.warning("could not join group %s: %s", request.group_id, exc)
                return
        with self._lock:
            self._groups[request.group_id] = stop
        labels = {"expert_id": self.expert_id}
        logger.info("serving group %s as rank %d of %d", request.group_id, request.rank,
                    request.world_size)  # fmt: skip
        graphs = PartialGraphs(self.store, port) if isinstance(port, StreamMember) else None
        try:
            while True:
                received = port.receive()
                if received is None:
                    break
                started = time.monotonic()
                with torch.inference_mode():
                    if graphs is not None:  # every token: this service's part, replied
                        layer, rows, weights, ids = received
                        graphs.answer(layer, rows, weights, ids)
                    else:
                        layer, rows, ids = received
                        port.reply(self.store.compute(layer, rows, ids))
                metrics.SERVICE_TOKENS.labels(**labels).inc(rows.shape[0])
                metrics.SERVICE_COMPUTE_SECONDS.labels(**labels).observe(time.monotonic() - started)
            logger.info("group %s: the worker left", request.group_id)
        except Exception as exc:  # the group broke; the worker forms a new one
            logger.warning("group %s ended: %s", request.group_id, str(exc)[:200])
        finally:
            with self._lock:
                self._groups.pop(request.group_id, None)
            end()

    def close(self, timeout: float = 5.0) -> None:
        """Aborts every group (their waits end) and joins the threads: a thread still
        inside a collective when the interpreter exits would abort the process."""
        with self._lock:
            stops, threads = list(self._groups.values()), list(self._threads.values())
        for stop in stops:
            stop()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
