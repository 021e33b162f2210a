"""A worker's entry in the scheduler's registry, kept there for the worker's
life: registered at start (retried until the scheduler answers), registered
again whenever the scheduler asks (it restarted, or it dropped the worker while
NATS was down), and withdrawn for good when the worker drains, so that nothing
new is placed on it while its streams finish."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from google.protobuf import empty_pb2

from proto.yinian.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.bus import EventBus, register_subject
from services.common.channels import OPTIONS
from services.common.tls import TlsFiles, aio_channel

logger = logging.getLogger(__name__)


class Registration:
    def __init__(self, scheduler: str, info: scheduler_pb2.WorkerInfo, tls: TlsFiles | None):
        self.scheduler = scheduler
        self.info = info
        self.tls = tls
        self.draining = False
        self._channel: grpc.aio.Channel | None = None
        self._again: asyncio.Task | None = None

    @property
    def _stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        if self._channel is None:
            self._channel = aio_channel(self.scheduler, self.tls, OPTIONS)
        return scheduler_pb2_grpc.SchedulerStub(self._channel)

    async def register(self, timeout: float = 60.0) -> None:
        """Registers, retrying until the scheduler answers or `timeout` passes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                await self._stub.Register(self.info, timeout=2.0)
                return
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.PERMISSION_DENIED,
                                  grpc.StatusCode.UNAUTHENTICATED):  # fmt: skip
                    raise RuntimeError(
                        f"the scheduler {self.scheduler} refused this worker: {exc.details()}"
                    ) from exc
                if loop.time() > deadline:
                    raise RuntimeError(
                        f"scheduler {self.scheduler} unreachable: {exc.details()}"
                    ) from exc
                await asyncio.sleep(0.3)

    async def listen(self, bus: EventBus) -> None:
        """Registers again when the scheduler asks (unless draining)."""

        def on_request(_message, _headers) -> None:
            if self.draining or (self._again is not None and not self._again.done()):
                return
            self._again = asyncio.create_task(self._register_again())

        await bus.subscribe(register_subject(self.info.worker_id), empty_pb2.Empty, on_request)

    async def _register_again(self) -> None:
        try:
            await self.register(timeout=10.0)
            logger.info("registered again with the scheduler at %s", self.scheduler)
        except RuntimeError as exc:
            logger.warning("could not register again: %s", exc)

    async def withdraw(self) -> None:
        """Leaves placement for good: deregisters, and ignores requests to come back."""
        self.draining = True
        if self._again is not None:
            self._again.cancel()
        with contextlib.suppress(grpc.RpcError):
            await self._stub.Deregister(
                scheduler_pb2.DeregisterRequest(worker_id=self.info.worker_id), timeout=1.0
            )

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
