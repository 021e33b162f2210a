"""The prefill service's process: a worker host (engine, gRPC, registration,
reports; services/worker/host.py) serving the `Prefill` service."""

from __future__ import annotations

import asyncio

from proto.yinian.v1 import worker_pb2_grpc
from services.kv_transport.registry import PerTransport, make_sender
from services.prefill.config import PrefillConfig
from services.prefill.prefill_core import PrefillCore
from services.prefill.servicer import PrefillServicer
from services.worker.host import WorkerHost


async def run(config: PrefillConfig) -> None:
    host = WorkerHost(config, "yinian-prefill")
    device, loop = host.engine.facts.device, asyncio.get_running_loop()
    senders = PerTransport(lambda name: make_sender(name, device, loop))
    host.on_close(senders.close)
    core = PrefillCore(host.engine, senders.get, host.shared)
    host.serve(
        worker_pb2_grpc.add_PrefillServicer_to_server, PrefillServicer(core), "yinian.v1.Prefill"
    )
    await host.run()
