"""The shared tier as an engine worker uses it, free of gRPC (the KV store
client is handed in): before a prompt runs, the blocks it lacks locally that
the shared tier holds are fetched and checked (shared_kv_reads.py); after a
request, blocks are written down under a policy (shared_kv_writes.py):

- `none`: nothing is written;
- `selective` (the default): the prompt's blocks that it found cached, i.e. a
  block goes down once it is reused (random traffic writes nothing);
- `prefix`: every full block of the prompt (a later request with this
  prefix, on any worker, skips it);
- `all`: also the blocks of the generated tokens (the next turn of a
  conversation, whose prompt holds this answer, skips it too).

No byte passes through the engine's thread or waits on its steps. A KV store
on this host lends the blocks its memory tier holds, which this worker copies
straight to the device (lent_blocks.py), writes what only Redis holds into
the host tier's shared memory (GetInto) and reads written blocks out of it
(PutFrom); a store elsewhere gets and sends bytes by value, copied and
checksummed in a thread. A block's hash is what it holds (chained over the
prompt and salted with the tenant), so a fetched block is used only under the
hash the prompt asks for.
"""

from __future__ import annotations

from engine import AsyncLLM
from services.common.kv_index import KvIndex
from services.worker.settings import WRITE_THROUGH
from services.worker.shared_kv_link import SharedKvLink, SharedKvStats
from services.worker.shared_kv_reads import SharedKvReads
from services.worker.shared_kv_writes import SharedKvWrites


class SharedKv:
    def __init__(
        self,
        engine: AsyncLLM,
        client,
        worker_id: str,
        policy: str = "selective",
        max_pending_bytes: int = 2048 << 20,
        index: KvIndex | None = None,
        verify_lent: bool = False,
        lend: bool = True,
    ):
        if policy not in WRITE_THROUGH:
            raise ValueError(f"write-through policy must be one of {WRITE_THROUGH}, got {policy!r}")
        self.link = SharedKvLink(engine, client, worker_id)
        # What the shared tier holds, from its events on NATS (the worker feeds it): a
        # prompt whose first block is not there costs no call to the store at all.
        self.index = index
        self.reads = SharedKvReads(self.link, index, verify_lent, lend)
        self.writes = SharedKvWrites(self.link, policy, max_pending_bytes)

    @property
    def stats(self) -> SharedKvStats:
        return self.link.stats

    @property
    def block_bytes(self) -> int:
        return self.link.block_bytes

    @property
    def max_pending_bytes(self) -> int:
        """The write queue's bound, in bytes."""
        return self.writes.max_pending_bytes

    @max_pending_bytes.setter
    def max_pending_bytes(self, value: int) -> None:
        self.writes.max_pending_bytes = value

    async def introduce(self) -> None:
        """Before any request: the store maps this worker's host tier, and this worker
        starts mapping (and on CUDA pinning) the store's memory tier, if it may (`lend`)."""
        await self.reads.introduce()

    async def prefetch(self, prompt_ids: list[int], tenant: str, public_tokens: int = 0) -> int:
        """Makes the prompt's missing leading blocks local from the shared tier; the
        prompt tokens it made local."""
        return await self.reads.prefetch(prompt_ids, tenant, public_tokens)

    def write_through(self, prompt_ids: list[int], output_ids: list[int], tenant: str,
                      public_tokens: int = 0, cached_tokens: int = 0) -> None:  # fmt: skip
        """Queues the blocks the policy chooses, written in the background."""
        self.writes.write_through(prompt_ids, output_ids, tenant, public_tokens, cached_tokens)

    async def drain(self) -> None:
        """Waits for the writes in flight (at shutdown)."""
        await self.writes.drain()
