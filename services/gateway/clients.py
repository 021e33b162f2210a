"""gRPC clients the gateway uses: the scheduler and a pool of worker channels.
Trace context rides in the call metadata."""

from __future__ import annotations

from contextlib import aclosing

import grpc

from proto.yinian.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.channels import OPTIONS as _OPTIONS
from services.common.channels import WorkerChannels
from services.common.errors import DeadlineExceeded, WorkerUnavailable, from_grpc_error
from services.common.grpc_streams import StreamIdle, read_stream
from services.common.telemetry import grpc_metadata
from services.common.tls import TlsFiles, aio_channel


class SchedulerClient:
    def __init__(self, address: str, timeout: float = 5.0, tls: TlsFiles | None = None):
        self.channel = aio_channel(address, tls, _OPTIONS)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.timeout = timeout

    async def place(
        self,
        request_id: str,
        prompt_tokens: int,
        block_hashes: list[int],
        tenant: str,
        exclude: list[str],
    ) -> scheduler_pb2.Placement:
        try:
            return await self.stub.Place(
                scheduler_pb2.PlaceRequest(
                    request_id=request_id,
                    prompt_tokens=prompt_tokens,
                    block_hashes=block_hashes,
                    tenant=tenant,
                    exclude_workers=exclude,
                ),
                timeout=self.timeout,
                metadata=grpc_metadata(),
                # A scheduler that is restarting is waited for (up to the timeout)
                # rather than answered with 503 at once.
                wait_for_ready=True,
            )
        except grpc.RpcError as exc:
            if self.channel.get_state() != grpc.ChannelConnectivity.READY:
                raise WorkerUnavailable(f"scheduler unreachable: {exc.details()}") from exc
            raise from_grpc_error(exc) from exc

    async def ready_workers(self) -> int:
        try:
            resp = await self.stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=1.0)
        except grpc.RpcError:
            return -1
        return sum(1 for w in resp.workers if w.ready and w.info.role in ("colocated", "decode"))

    async def close(self) -> None:
        await self.channel.close()


class WorkerPool(WorkerChannels):
    """The gateway's calls to workers."""

    async def generate(
        self, address: str, request: worker_pb2.GenerateRequest, timeout: float, idle_timeout: float
    ):
        """Streams the worker's chunks. A broken or silent worker becomes a
        WorkerUnavailable / DeadlineExceeded; leaving early cancels the call, which
        aborts the request on the worker (grpc_streams.read_stream says when)."""
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
