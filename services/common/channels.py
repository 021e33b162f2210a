"""gRPC channels to workers, one per address, opened on first use and shared by
every stub of that address."""

from __future__ import annotations

import grpc

OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024), ("grpc.enable_retries", 0)]


class WorkerChannels:
    def __init__(self):
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=OPTIONS)
            self._channels[address] = channel
        return channel

    def stub(self, address: str, stub_type):
        return stub_type(self.channel(address))

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
