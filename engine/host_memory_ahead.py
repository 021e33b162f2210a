"""The host tier's memory, allocated and pinned on a thread of its own while the
runner warms up: pinning the tier (16 GiB by default) takes seconds that need not
delay the engine's start. The runner `start`s it once the device's KV cache exists
(its blocks' size sizes the tier) and `settle`s it before capturing CUDA graphs (a
capture must not overlap other CUDA calls); the tiers `take` it. Where it never
started (a mock runner, a parallel rank), the tiers allocate as before."""

from __future__ import annotations

import threading

import torch

from basis.host_regions import available_host_gb
from engine import host_memory
from engine.config import EngineConfig
from engine.host_tier import HostTier

DEFAULT_FRACTION = 0.2  # of the host memory available at start-up
DEFAULT_CAP_GB = 16.0


def host_tier_gb(config: EngineConfig) -> float:
    if config.host_kv_cache_gb is not None:
        return config.host_kv_cache_gb
    return min(DEFAULT_FRACTION * available_host_gb(), DEFAULT_CAP_GB)


def wants_host_tier(config: EngineConfig) -> bool:
    """Without prefix caching nothing could ever hit the host tier. A parallel engine's
    rank 0 holds only its part of each block (its heads, its stage's layers), so the
    tiers below the device, which would move only that part, are off there."""
    parallel = config.tensor_parallel_size * config.pipeline_parallel_size > 1
    return config.enable_prefix_caching and not parallel


class HostMemoryAhead:
    def __init__(self, config: EngineConfig):
        self.config = config
        self._thread: threading.Thread | None = None
        self._result: tuple[int, host_memory.HostMemory] | BaseException | None = None

    def start(self, kv_caches: list[torch.Tensor]) -> None:
        """Starts allocating the tier for blocks of these caches (once, if wanted)."""
        if self._thread is not None or not wants_host_tier(self.config):
            return
        num_blocks = HostTier.blocks_for(kv_caches, host_tier_gb(self.config))
        if num_blocks < 1:
            return
        first = kv_caches[0]
        shape = (num_blocks, len(kv_caches), *first.shape[1:])
        cuda = first.device.type == "cuda"

        def allocate() -> None:
            try:
                if cuda:  # the engine's device, not device 0 (a context of its own there)
                    torch.cuda.set_device(first.device)
                self._result = (num_blocks, host_memory.allocate(shape, first.dtype, cuda))
            except BaseException as exc:  # noqa: BLE001 - raised again by take()
                self._result = exc

        self._thread = threading.Thread(target=allocate, name="host-tier-memory", daemon=True)
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def settle(self) -> None:
        """Returns once the allocation (if started) is done."""
        if self._thread is not None:
            self._thread.join()

    def take(self) -> tuple[int, host_memory.HostMemory] | None:
        """(blocks, memory) of the tier, once; None if it never started."""
        self.settle()
        result, self._result = self._result, None
        if isinstance(result, BaseException):
            raise result
        return result
