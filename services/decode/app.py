"""The decode service's process: a worker host (engine, gRPC, registration,
reports; services/worker/host.py) serving the `Decode` service, plus,
in the decode role, the client and receivers of KV handoffs."""

from __future__ import annotations

from proto.yinian.v1 import worker_pb2_grpc
from services.decode.config import DecodeConfig
from services.decode.decode_core import DecodeCore
from services.decode.prefill_client import PrefillClient
from services.decode.remote_prefill import RemotePrefill
from services.decode.servicer import DecodeServicer
from services.worker.host import WorkerHost


async def run(config: DecodeConfig) -> None:
    host = WorkerHost(config, f"yinian-{config.role}")
    remote = None
    if config.role == "decode":
        client = PrefillClient(config.tls_files())
        remote = RemotePrefill(
            host.engine,
            client,
            host.endpoint,
            config.worker_id,
            config.kv_lease_seconds,
            config.prefill_timeout,
        )
        host.on_close(client.close)
        host.on_close(remote.close)
    core = DecodeCore(host.engine, config.worker_id, remote, host.shared)
    servicer = DecodeServicer(core, host.server.in_flight)
    host.serve(worker_pb2_grpc.add_DecodeServicer_to_server, servicer, "yinian.v1.Decode")
    host.on_close(servicer.close_links)  # before the server stops: no call left open
    await host.run()
