"""The host tier of the KV cache: blocks that left the device, kept in host
memory (pinned on CUDA) so a later prompt loads them instead of recomputing.

Layout: one tensor [host blocks, layers, *one layer's block], so a block across
all its layers is one contiguous piece: it moves in one copy (and is what the
shared tier stores), never layer by layer. Device blocks are gathered into (or
scattered from) a staging buffer of the same layout on the device.

- `backup`: blocks that just became free but stay cached on the device are
  copied to the host on a side stream, after the work already queued; each
  device block keeps a reference until its copy is done (`poll`), so it cannot
  be reused under the copy. Nothing waits for a backup. On CUDA a kernel of a
  few programs stores the blocks straight into the slots
  (`kernels/host_blocks.py`): copies through the copy engine would queue every
  step's read-back of its sampled tokens behind them. `YINIAN_HOST_COPY=engine`
  takes the copy engine instead (to compare).
- `backup_evicted`: blocks the device pool is handing out again are gathered
  on the compute stream before the step that overwrites them, then copied to
  the host on the side stream (write-back: nothing moves until the device
  needs the room).
- `load`: host blocks a prompt hits are copied into freshly allocated device
  blocks on the compute stream, before the step that reads them.
- `slot_bytes`: a host slot as a writable uint8 array over its pinned memory,
  for the shared tier to read or fill from another thread while the slot is
  pinned (the engine thread only pins and unpins: no bytes pass through it).
- `import_block` / `export_block`: one block's bytes in and out, synchronously
  (for tools and tests; the worker uses `slot_bytes`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from engine import host_memory
from engine.block_pool import BlockPool, KVBlock
from engine.host_pool import HostBlockPool
from kernels import host_blocks

_STAGING_BYTES = 256 << 20  # device staging per copy batch


@dataclass(eq=False)
class _InFlight:
    event: object | None  # a CUDA event, None on CPU (done at once)
    stores: list[int] = field(default_factory=list)  # host slots being written
    device_blocks: list[KVBlock] = field(default_factory=list)  # referenced until done
    reads: list[int] = field(default_factory=list)  # host slots being read (pinned)
    staging: object | None = None  # a device buffer the copies read, kept until done


@dataclass(slots=True)
class HostTierStats:
    blocks_backed_up: int = 0
    blocks_loaded: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    load_seconds: float = 0.0  # host time spent issuing loads (and waiting, on CPU)


class HostTier:
    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        num_blocks: int,
        memory: host_memory.HostMemory | None = None,
    ):
        """`memory`: the tier's, allocated already (engine/host_memory_ahead.py)."""
        first = kv_caches[0]
        self.device = first.device
        self.block_shape = tuple(first.shape[1:])
        self.num_layers = len(kv_caches)
        self.kv_caches = kv_caches
        cuda = self.device.type == "cuda"
        # empty, not zeros: untouched host pages cost nothing until a block lands
        shape = (num_blocks, self.num_layers, *self.block_shape)
        if memory is None:
            memory = host_memory.allocate(shape, first.dtype, cuda)
        elif tuple(memory.tensor.shape) != shape or memory.tensor.dtype != first.dtype:
            raise ValueError(f"host tier memory {tuple(memory.tensor.shape)} "
                             f"{memory.tensor.dtype} is not {shape} {first.dtype}")  # fmt: skip
        self.memory = memory
        self.blocks = self.memory.tensor
        self.pool = HostBlockPool(num_blocks)
        self.bytes_per_block = self.blocks[0].numel() * self.blocks.element_size()
        self.chunk = max(1, min(num_blocks, _STAGING_BYTES // self.bytes_per_block))
        self.side = torch.cuda.Stream(self.device) if cuda else None
        # backups by a kernel storing into the slots, where it can (see the module's note)
        self.kernel_writes = (
            cuda
            and os.environ.get("YINIAN_HOST_COPY", "kernel") != "engine"
            and host_blocks.usable(kv_caches, self.blocks)
        )
        self._inflight: list[_InFlight] = []
        self.stats = HostTierStats()

    @staticmethod
    def blocks_for(kv_caches: list[torch.Tensor], gigabytes: float) -> int:
        per_block = sum(c[0].numel() * c.element_size() for c in kv_caches)
        return int(gigabytes * (1 << 30) // per_block)

    # -- device -> host ----------------------------------------------------------
    def backup(self, blocks: list[KVBlock], device_pool: BlockPool) -> int:
        """Starts copying cached device blocks to the host (those not there yet);
        returns how many copies started."""
        pairs = []
        for block in blocks:
            if block.block_hash is None:
                continue
            if self.pool.contains(block.block_hash):
                # used again: its host copy moves to the back of the LRU like any
                # reuse (a conversation's head, reused at every turn, must not age out
                # behind blocks nobody read twice)
                self.pool.lookup(block.block_hash)
                continue
            slot = self.pool.begin_store(block.block_hash)
            if slot is None:
                break  # every slot is pinned by copies in flight
            device_pool.touch([block])
            pairs.append((block, slot))
        if not pairs:
            return 0
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side):
                self._to_host(pairs)
                event = torch.cuda.Event()
                event.record(self.side)
        else:
            self._to_host(pairs)
            event = None
        return self._started(_InFlight(event, [s for _, s in pairs], [b for b, _ in pairs]))

    def backup_evicted(self, evicted: list[tuple[int, int]], wait: bool = False) -> int:
        """Copies blocks the device pool is evicting, [(device block id, hash)], to the
        host. Their contents are gathered on the compute stream now, before any
        later work there can overwrite the blocks, and go to the host on the side
        stream; with `wait`, this returns once the gather is done (the blocks may
        be written from outside the stream next). At most one staging buffer's
        worth per call; returns how many copies started."""
        pairs = []
        for block_id, block_hash in evicted[: self.chunk]:
            slot = self.pool.begin_store(block_hash)
            if slot is not None:
                pairs.append((block_id, slot))
        if not pairs:
            return 0
        slots = [s for _, s in pairs]
        staging = self._gather(ids_on(self.device, [b for b, _ in pairs]))
        event = None
        if self.side is None:
            self._copy_rows(staging, slots)
        else:
            gathered = torch.cuda.Event()
            gathered.record(torch.cuda.current_stream(self.device))
            self.side.wait_event(gathered)
            with torch.cuda.stream(self.side):
                self._copy_rows(staging, slots)
                event = torch.cuda.Event()
                event.record(self.side)
            if wait:
                gathered.synchronize()
        return self._started(_InFlight(event, slots, staging=staging))

    def _started(self, op: _InFlight) -> int:
        """Tracks copies to the host until `poll` finds them done; how many started."""
        self._inflight.append(op)
        self.stats.blocks_backed_up += len(op.stores)
        self.stats.bytes_to_host += len(op.stores) * self.bytes_per_block
        return len(op.stores)

    def _copy_rows(self, staging: torch.Tensor, slots: list[int]) -> None:
        """Row i of a gathered staging buffer into host slot slots[i] (on the current
        stream, without waiting, on CUDA)."""
        for row, slot in enumerate(slots):
            self.blocks[slot].copy_(staging[row], non_blocking=self.side is not None)

    def _gather(self, ids: torch.Tensor) -> torch.Tensor:
        """The blocks `ids` across every layer, [n, layers, *block], on the device."""
        staging = torch.empty(
            (len(ids), self.num_layers, *self.block_shape),
            dtype=self.blocks.dtype,
            device=self.device,
        )
        for layer, cache in enumerate(self.kv_caches):
            staging[:, layer] = cache.index_select(0, ids)
        return staging

    def _to_host(self, pairs: list[tuple[KVBlock, int]]) -> None:
        if self.kernel_writes:
            ids = ids_on(self.device, [b.block_id for b, _ in pairs])
            host_blocks.blocks_to_host(self.kv_caches, self.blocks, ids,
                                       ids_on(self.device, [s for _, s in pairs]))  # fmt: skip
            return
        for start in range(0, len(pairs), self.chunk):
            part = pairs[start : start + self.chunk]
            ids = ids_on(self.device, [b.block_id for b, _ in part])
            self._copy_rows(self._gather(ids), [slot for _, slot in part])

    # -- host -> device ----------------------------------------------------------
    def load(self, pairs: list[tuple[int, int]]) -> None:
        """Copies host slots into device blocks, [(slot, device block id)], on the
        current stream; the slots stay pinned until the copies are done."""
        if not pairs:
            return
        start = time.perf_counter()
        copy_rows_to_blocks([self.blocks[slot] for slot, _ in pairs], [b for _, b in pairs],
                            self.kv_caches, self.chunk)  # fmt: skip
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._inflight.append(_InFlight(event, reads=[slot for slot, _ in pairs]))
        self.stats.blocks_loaded += len(pairs)
        self.stats.bytes_to_device += len(pairs) * self.bytes_per_block
        self.stats.load_seconds += time.perf_counter() - start

    # -- completion ----------------------------------------------------------------
    def poll(self, device_pool: BlockPool, wait: bool = False) -> None:
        """Finishes the copies that are done (all of them, with `wait`): backed-up
        blocks become readable here and their device blocks are let go."""
        keep = []
        for op in self._inflight:
            if op.event is not None and not (wait or op.event.query()):
                keep.append(op)
                continue
            if op.event is not None and wait:
                op.event.synchronize()
            for slot in op.stores:
                self.pool.end_store(slot)
            for slot in op.reads:
                self.pool.unpin(slot)
            if op.device_blocks:
                device_pool.free(op.device_blocks)
        self._inflight = keep

    def close(self) -> None:
        self.memory.close()

    # -- the shared tier's side --------------------------------------------------
    @property
    def region(self) -> tuple[str, int] | None:
        """(path, size) of the shared-memory file holding the tier, if it is one;
        slot i's bytes start at i * bytes_per_block."""
        if self.memory.path is None:
            return None
        return str(self.memory.path), self.memory.size

    def slot_bytes(self, slot: int):
        """The slot's memory as a flat numpy uint8 array (no copy). Any thread may
        read or write it while the slot is pinned or being stored."""
        return self.blocks[slot].view(-1).view(torch.uint8).numpy()

    def export_block(self, block_hash: int, device_block: KVBlock | None = None) -> bytes | None:
        """The block's bytes (layer after layer): from the host tier, else from
        `device_block` (a synchronous copy); None when neither has it."""
        slot = self.pool.lookup(block_hash)
        if slot is not None:
            return _as_bytes(self.blocks[slot])
        if device_block is None or device_block.block_hash != block_hash:
            return None
        rows = torch.stack([cache[device_block.block_id] for cache in self.kv_caches])
        return _as_bytes(rows.cpu())

    def import_block(self, block_hash: int, data: bytes) -> bool:
        """Stores a verified block from elsewhere; False when its size is wrong or
        no slot is free."""
        if len(data) != self.bytes_per_block:
            return False
        slot = self.pool.begin_store(block_hash)
        if slot is None:
            return self.pool.contains(block_hash)
        self.slot_bytes(slot)[:] = memoryview(data).cast("B")
        self.pool.end_store(slot)
        return True


def copy_rows_to_blocks(
    rows: list[torch.Tensor], block_ids: list[int], kv_caches: list[torch.Tensor],
    chunk: int = 0,
) -> None:  # fmt: skip
    """rows[i], one block across every layer ([layers, *block], in host memory; pinned
    for the copy to be asynchronous), into device block block_ids[i] of each layer's
    cache, on the current stream: each row in one copy into a device staging buffer
    (`chunk` rows at a time), then one scatter per layer."""
    first_cache = kv_caches[0]
    shape = (len(kv_caches), *first_cache.shape[1:])
    if chunk <= 0:
        per_block = first_cache[0].numel() * first_cache.element_size() * len(kv_caches)
        chunk = max(1, _STAGING_BYTES // per_block)
    for first in range(0, len(rows), chunk):
        part = rows[first : first + chunk]
        staging = torch.empty((len(part), *shape), dtype=first_cache.dtype,
                              device=first_cache.device)  # fmt: skip
        for start, count in _runs(part):  # rows side by side in memory: one copy each run
            source = part[start]
            if count > 1:
                source = source.as_strided(
                    (count, *source.shape), (source.numel(), *source.stride())
                )
            staging[start : start + count].copy_(source, non_blocking=True)
        ids = ids_on(first_cache.device, block_ids[first : first + chunk])
        for layer, cache in enumerate(kv_caches):
            cache.index_copy_(0, ids, staging[:, layer])


def ids_on(device: torch.device, ids: list[int]) -> torch.Tensor:
    """Block ids as a tensor on `device`. On CUDA through pinned memory, asynchronously:
    a plain copy (torch.tensor(..., device=...)) waits for every kernel queued on the
    stream, which stalled the engine's steps wherever blocks went to the host."""
    out = torch.tensor(ids, dtype=torch.long)
    return out.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else out


def _runs(rows: list[torch.Tensor]) -> list[tuple[int, int]]:
    """(first, count) of each run of rows that lie one after another in one storage."""
    runs: list[tuple[int, int]] = []
    for i, row in enumerate(rows):
        if runs and i > 0:
            last = rows[i - 1]
            end = last.data_ptr() + last.numel() * last.element_size()
            if row.data_ptr() == end and row.untyped_storage().data_ptr() == (
                last.untyped_storage().data_ptr()
            ):
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
                continue
        runs.append((i, 1))
    return runs


def _as_bytes(block: torch.Tensor) -> bytes:
    return block.contiguous().view(torch.uint8).numpy().tobytes()
