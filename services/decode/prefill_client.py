"""gRPC calls a decode worker makes to prefill workers."""

from __future__ import annotations

from contextlib import aclosing

import grpc

from engine.request import EngineRequest
from proto.yinian.v1 import worker_pb2, worker_pb2_grpc
from services.common.channels import WorkerChannels
from services.common.errors import from_grpc_error
from services.common.grpc_streams import read_stream
from services.common.telemetry import grpc_metadata
from services.common.tls import TlsFiles
from services.worker.handoff import HandoffOrder, PrefillResult
from services.worker.wire import prefill_to_proto, result_from_chunk


class PrefillClient:
    def __init__(self, tls: TlsFiles | None = None):
        self._channels = WorkerChannels(tls)
        self._info: dict[str, dict] = {}

    def _prefill(self, address: str) -> worker_pb2_grpc.PrefillStub:
        return self._channels.stub(address, worker_pb2_grpc.PrefillStub)

    async def info(self, address: str) -> dict:
        """The prefill worker's host, device and transports (cached per address)."""
        if address not in self._info:
            stub = self._channels.stub(address, worker_pb2_grpc.WorkerStub)
            try:
                info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5.0)
            except grpc.RpcError as exc:
                raise from_grpc_error(exc) from exc
            self._info[address] = {
                "host": info.host,
                "device": info.device,
                "transports": list(info.transports),
                "worker_id": info.worker_id,
            }
        return self._info[address]

    def forget(self, address: str) -> None:
        """After a failure: the worker may come back as someone else."""
        self._info.pop(address, None)

    async def prefill(
        self, address: str, request: EngineRequest, order: HandoffOrder, *, timeout: float
    ) -> PrefillResult:
        message = prefill_to_proto(request, order)
        done = None
        try:
            call = self._prefill(address).Prefill(
                message, timeout=timeout, metadata=grpc_metadata()
            )
            async with aclosing(read_stream(call)) as chunks:
                async for chunk in chunks:
                    if chunk.error:
                        raise RuntimeError(chunk.error)
                    if chunk.done:
                        done = chunk
        except grpc.RpcError as exc:
            self.forget(address)
            raise from_grpc_error(exc) from exc
        if done is None:
            raise RuntimeError(f"prefill worker {address} ended without finishing")
        return result_from_chunk(done)

    async def release(self, address: str, lease_id: str) -> None:
        try:
            await self._prefill(address).ReleaseKv(
                worker_pb2.ReleaseKvRequest(lease_id=lease_id), timeout=5.0
            )
        except grpc.RpcError:
            pass  # the lease runs out on its own

    async def close(self) -> None:
        await self._channels.close()
