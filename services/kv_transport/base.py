"""The KV transport interface.

A decode worker owns a `KvReceiver` over its engine's KV cache; it tells a
prefill worker where to write (`target()`, opaque bytes) and which of its
blocks to fill. The prefill worker's `KvSender` moves the prompt's blocks
layer by layer as soon as each layer is computed, then `flush()` waits until
everything it sent has landed (or failed). The decode side's
`wait(request_id)` returns once every layer of a request is in its cache.

Cache layout on both sides (per layer): [num_blocks, 2, block_size, kv_heads,
head_dim], block-major, so one block of one layer is one contiguous piece.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field


class TransferError(RuntimeError):
    """A transfer failed or timed out; the request's blocks hold nothing usable."""


@dataclass(slots=True)
class TransferStats:
    bytes: int = 0
    seconds: float = 0.0
    layers: int = 0
    blocks: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(slots=True)
class LayerPlan:
    """Which blocks of one request move: source ids (prefill side) to destination ids."""

    request_id: str
    src_block_ids: list[int]
    dst_block_ids: list[int]
    num_layers: int
    stats: TransferStats = field(default_factory=TransferStats)


class KvReceiver(abc.ABC):
    name: str

    async def start(self) -> None:  # noqa: B027 - nothing to start by default
        """Gets ready to receive (listens, for tcp and nccl); before `target()`."""

    @abc.abstractmethod
    def target(self) -> bytes:
        """What a sender needs to reach this receiver (address, handles, ...)."""

    @abc.abstractmethod
    def expect(self, request_id: str, dst_block_ids: list[int], num_layers: int) -> None:
        """Announces a transfer into these blocks, before the sender starts."""

    @abc.abstractmethod
    async def wait(self, request_id: str, timeout: float) -> TransferStats:
        """Returns when every layer of the request has landed; TransferError otherwise."""

    @abc.abstractmethod
    def cancel(self, request_id: str) -> None:
        """Forgets a transfer (the request moved elsewhere); late data is dropped."""

    def mark_done(self, request_id: str, stats: TransferStats | None = None) -> None:  # noqa: B027
        """The sender's flush succeeded. A transport whose receiver sees no data
        (cuda_ipc: the sender writes this cache directly) completes `wait` here;
        the others complete it as the last layer lands, and ignore this."""

    async def close(self) -> None:  # noqa: B027 - optional
        pass


class KvSender(abc.ABC):
    name: str

    @abc.abstractmethod
    def begin(self, plan: LayerPlan, target: bytes) -> None:
        """Starts a transfer of `plan` to the receiver described by `target`."""

    @abc.abstractmethod
    def send_layer(self, request_id: str, layer: int, cache_layer) -> None:
        """Sends one layer's blocks; called on the engine thread right after the
        layer is computed. Must not block on the network: enqueue and return."""

    @abc.abstractmethod
    async def flush(self, request_id: str, timeout: float) -> TransferStats:
        """Waits until everything sent for the request has landed."""

    def abort(self, request_id: str) -> None:  # noqa: B027 - optional
        pass

    async def close(self) -> None:  # noqa: B027 - optional
        pass
