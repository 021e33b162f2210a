"""Picks and builds KV transports by name.

An endpoint (what a worker advertises) is {"host": ..., "device": "cpu" | "cuda"
(or "cuda:N"), "transports": [...]}. Preference: cuda_ipc on one host (GPU to GPU, no copy
through the host or the network), nccl between GPUs of different hosts, tcp
otherwise. A transport other than tcp is chosen only if both ends list it (an
endpoint without a "transports" key supports all), since each one can be
unusable in a given deployment (GPUs hidden from each other, no NCCL path).
Modules load lazily: a CPU-only service never imports the GPU paths.

Receivers need `await receiver.start()` before `target()` (tcp and nccl listen).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from services.kv_transport.base import KvReceiver, KvSender

TRANSPORTS = ("cuda_ipc", "nccl", "tcp")


def _supports(endpoint: dict, name: str) -> bool:
    return name == "tcp" or name in endpoint.get("transports", TRANSPORTS)


def _device_type(endpoint: dict) -> str:
    return str(endpoint.get("device", "cpu")).split(":")[0]  # "cuda:0" is a CUDA device


def choose_transport(local: dict, remote: dict) -> str:
    both_cuda = _device_type(local) == "cuda" and _device_type(remote) == "cuda"
    same_host = local.get("host") == remote.get("host")
    for name, fits in (("cuda_ipc", both_cuda and same_host), ("nccl", both_cuda)):
        if fits and _supports(local, name) and _supports(remote, name):
            return name
    return "tcp"


def make_receiver(name: str, kv_caches: list[torch.Tensor], host: str) -> KvReceiver:
    if name == "tcp":
        from services.kv_transport.tcp import TcpReceiver

        return TcpReceiver(kv_caches, host)
    if name == "nccl":
        from services.kv_transport.nccl import NcclReceiver

        return NcclReceiver(kv_caches, host)
    if name == "cuda_ipc":
        from services.kv_transport.cuda_ipc import CudaIpcReceiver

        return CudaIpcReceiver(kv_caches)
    raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(TRANSPORTS)}")


def make_sender(name: str, device, loop: asyncio.AbstractEventLoop) -> KvSender:
    if name == "tcp":
        from services.kv_transport.tcp import TcpSender

        return TcpSender(loop)
    if name == "nccl":
        from services.kv_transport.nccl import NcclSender

        return NcclSender(device)
    if name == "cuda_ipc":
        from services.kv_transport.cuda_ipc import CudaIpcSender

        return CudaIpcSender(device)
    raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(TRANSPORTS)}")


class PerTransport:
    """A worker's endpoints of one kind, one per transport name, made by `make(name)` on
    first use and closed together: its senders (`get`) or its receivers (`started`:
    a receiver listens before its target is told)."""

    def __init__(self, make: Callable[[str], KvSender | KvReceiver]):
        self._make = make
        self._made: dict[str, KvSender | KvReceiver] = {}
        self._lock = asyncio.Lock()

    def get(self, name: str):
        if name not in self._made:
            self._made[name] = self._make(name)
        return self._made[name]

    async def started(self, name: str):
        async with self._lock:
            if name not in self._made:
                endpoint = self._make(name)
                await endpoint.start()
                self._made[name] = endpoint
            return self._made[name]

    async def close(self) -> None:
        for endpoint in self._made.values():
            await endpoint.close()
