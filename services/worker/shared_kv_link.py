"""What a worker's reads of the shared tier and its writes to it share (see
shared_kv.py): the engine, the store's client, block sizes, the host tier's
shared memory, statistics, and the hashes known to be in the store."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from engine import AsyncLLM
from services.common import metrics

logger = logging.getLogger("services.worker.shared_kv")
_REMEMBERED = 1 << 16  # hashes known to be in the store, not written again


@dataclass(slots=True)
class SharedKvStats:
    fetched_blocks: int = 0
    lent_blocks: int = 0  # of those, copied straight to the device from the store's memory
    fetched_bytes: int = 0
    fetch_seconds: float = 0.0
    rejected_blocks: int = 0  # came back but failed a check here
    written_blocks: int = 0
    written_bytes: int = 0
    dropped_blocks: int = 0  # chosen by the policy, not written (queue full, gone, refused)


@dataclass(eq=False)
class SharedKvLink:
    """What reads and writes share: the engine, the store's client, the block sizes,
    the host tier's shared memory (None: blocks go by value), the statistics, and the
    hashes known to be in the store."""

    engine: AsyncLLM
    client: object
    worker_id: str
    stats: SharedKvStats = field(default_factory=SharedKvStats)
    known: OrderedDict = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        self.block_size = self.engine.facts.block_size
        self.block_bytes = self.engine.facts.kv_block_bytes
        # a KV store on this host reads and fills it itself
        self.region = self.engine.host_region

    def remember(self, block_hash: int) -> None:
        self.known[block_hash] = None
        self.known.move_to_end(block_hash)
        if len(self.known) > _REMEMBERED:
            self.known.popitem(last=False)

    def rejected(self, block_hash: int) -> None:
        self.stats.rejected_blocks += 1
        metrics.KV_SHARED_REJECTED.labels(worker=self.worker_id).inc()
        logger.warning("shared block %x does not fit this prompt; recomputing", block_hash)

    def no_region(self) -> None:
        logger.info("the KV store cannot map this worker's host tier (another host?); "
                    "blocks go by value")  # fmt: skip
        self.region = None
