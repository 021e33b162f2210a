"""gRPC clients the gateway uses: the scheduler and a pool of worker channels.
Trace context rides in the call metadata.

While the scheduler is away (restarting: unreachable, or back but with no worker
registered yet; or stuck: no answer within `AWAY_WAIT`), a request is not
refused: it goes where the scheduler placed recent requests (`RecentPlacements`,
the last `RECENT_SECONDS`, round robin, skipping the workers the request
excludes). A worker that is gone by then fails like any other and the request is
placed again."""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from contextlib import aclosing

import grpc

from proto.yinian.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.channels import OPTIONS as _OPTIONS
from services.common.channels import WorkerChannels
from services.common.errors import DeadlineExceeded, WorkerUnavailable, from_grpc_error
from services.common.grpc_streams import StreamIdle, read_stream
from services.common.placement import SERVING_ROLES
from services.common.telemetry import grpc_metadata
from services.common.tls import TlsFiles, aio_channel
from services.gateway.worker_link import WorkerLink

logger = logging.getLogger(__name__)
RECENT_SECONDS = 60.0
AWAY_WAIT = 1.0  # seconds a placement waits for the scheduler when it has a fallback


class RecentPlacements:
    """The scheduler's recent answers, by (decode worker, prefill worker)."""

    def __init__(self, seconds: float = RECENT_SECONDS, clock=time.monotonic):
        self.seconds, self.clock = seconds, clock
        self._seen: OrderedDict[tuple[str, str], tuple[scheduler_pb2.Placement, float]] = (
            OrderedDict()
        )
        self._turn = itertools.count()

    def add(self, placement: scheduler_pb2.Placement) -> None:
        key = (placement.worker_id, placement.prefill_worker_id)
        self._seen[key] = (placement, self.clock())
        self._seen.move_to_end(key)

    def __bool__(self) -> bool:
        return bool(self._seen)

    def pick(self, exclude: list[str]) -> scheduler_pb2.Placement | None:
        """A recent placement none of whose workers `exclude` names (round robin)."""
        now = self.clock()
        for key in [k for k, (_, t) in self._seen.items() if now - t > self.seconds]:
            del self._seen[key]
        usable = [p for p, _ in self._seen.values()
                  if p.worker_id not in exclude and p.prefill_worker_id not in exclude]  # fmt: skip
        if not usable:
            return None
        chosen = usable[next(self._turn) % len(usable)]
        out = scheduler_pb2.Placement()
        out.CopyFrom(chosen)
        out.matched_blocks = 0  # nothing is known of this prompt's blocks there
        return out


class SchedulerClient:
    def __init__(self, address: str, timeout: float = 5.0, tls: TlsFiles | None = None):
        self.channel = aio_channel(address, tls, _OPTIONS)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.timeout = timeout
        self.recent = RecentPlacements()

    async def place(
        self,
        request_id: str,
        prompt_tokens: int,
        block_hashes: list[int],
        tenant: str,
        exclude: list[str],
        block_size: int = 0,
    ) -> scheduler_pb2.Placement:
        # with recent placements to fall back on, a short wait (a scheduler answers in
        # milliseconds); without, the whole timeout (one restarting is waited for)
        wait = min(self.timeout, AWAY_WAIT) if self.recent else self.timeout
        try:
            placement = await self.stub.Place(
                scheduler_pb2.PlaceRequest(
                    request_id=request_id,
                    prompt_tokens=prompt_tokens,
                    block_hashes=block_hashes,
                    tenant=tenant,
                    exclude_workers=exclude,
                    block_size=block_size,
                ),
                timeout=wait,
                metadata=grpc_metadata(),
                # A scheduler that is restarting is waited for (up to the timeout)
                # rather than answered with 503 at once.
                wait_for_ready=True,
            )
        except grpc.RpcError as exc:
            if self.channel.get_state() != grpc.ChannelConnectivity.READY:
                error = WorkerUnavailable(f"scheduler unreachable: {exc.details()}")
            else:
                error = from_grpc_error(exc)
            # the scheduler away, stuck, or (just restarted) knowing no worker yet
            away = isinstance(error, (WorkerUnavailable, DeadlineExceeded))
            fallback = self.recent.pick(exclude) if away else None
            if fallback is None:
                raise error from exc
            logger.warning("placement failed (%s); %s placed as a recent request was",
                           error, request_id)  # fmt: skip
            return fallback
        self.recent.add(placement)
        return placement

    def hash_block_size(self, default: int) -> int:
        """The blocks to hash a prompt in (the gateway's --block-size: the workers' own
        are not known here)."""
        return default

    async def list_workers(self, timeout: float = 1.0) -> scheduler_pb2.ListWorkersResponse:
        """The scheduler's workers and placement settings (grpc.RpcError when it is away)."""
        return await self.stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=timeout)

    async def close(self) -> None:
        await self.channel.close()


def serving_workers(listing: scheduler_pb2.ListWorkersResponse) -> int:
    """The ready workers a request can be placed on (colocated or decode) in a list."""
    return sum(1 for w in listing.workers if w.ready and w.info.role in SERVING_ROLES)


class WorkerPool(WorkerChannels):
    """The gateway's calls to workers: over one link a worker (worker_link.py), or
    with `links=False` one Generate call a request."""

    def __init__(self, tls: TlsFiles | None = None, links: bool = True):
        super().__init__(tls)
        self.links: dict[str, WorkerLink] | None = {} if links else None
        self.closed = False

    def generate(
        self, address: str, request: worker_pb2.GenerateRequest, timeout: float, idle_timeout: float
    ):
        """Streams the worker's chunks. A broken or silent worker becomes a
        WorkerUnavailable / DeadlineExceeded; leaving early aborts the request on
        the worker."""
        if self.links is None:
            return self._call(address, request, timeout, idle_timeout)
        if self.closed:
            raise WorkerUnavailable("the gateway is stopping")
        link = self.links.get(address)
        if link is None or link.broken is not None:
            for gone in [a for a, k in self.links.items() if k.broken is not None]:
                del self.links[gone]  # broken: its worker died, restarted or left
            stub = self.stub(address, worker_pb2_grpc.DecodeStub)
            link = WorkerLink(stub, address, tick=min(1.0, idle_timeout / 4, timeout / 4))
            self.links[address] = link
        return link.generate(request, timeout, idle_timeout)

    async def close(self) -> None:
        self.closed = True
        for link in list((self.links or {}).values()):
            await link.close()
        await super().close()

    async def _call(
        self, address: str, request: worker_pb2.GenerateRequest, timeout: float, idle_timeout: float
    ):
        """One Generate call (grpc_streams.read_stream says when leaving cancels it)."""
        stub = self.stub(address, worker_pb2_grpc.DecodeStub)
        call = stub.Generate(request, timeout=timeout, metadata=grpc_metadata())
        try:
            async with aclosing(read_stream(call, idle_timeout)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except StreamIdle as exc:
            raise DeadlineExceeded(
                f"worker {address} sent nothing for {idle_timeout:.0f} s"
            ) from exc
        except grpc.RpcError as exc:
            raise from_grpc_error(exc) from exc
