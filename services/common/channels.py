"""gRPC channels to workers, one per address, opened on first use and shared by
every stub of that address; TLS when the service has a certificate."""

from __future__ import annotations

import grpc

from services.common.tls import TlsFiles, aio_channel

OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.enable_retries", 0),
    # A peer that restarts (the scheduler, a worker) is reconnected to within a
    # second, not after gRPC's default back-off of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class WorkerChannels:
    def __init__(self, tls: TlsFiles | None = None):
        self.tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = aio_channel(address, self.tls, OPTIONS)
            self._channels[address] = channel
        return channel

    def stub(self, address: str, stub_type):
        return stub_type(self.channel(address))

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
