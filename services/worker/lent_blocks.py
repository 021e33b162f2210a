"""Blocks a KV store on this host lends: its memory tier is a file in shared
memory that this worker maps (and, on CUDA, pins: engine/store_memory.py) once,
in the background. For a prompt, the store says where the leading blocks it
holds lie (Lend) and keeps them in place for a few seconds, and this worker
copies them from there straight into device blocks the engine holds for them.
No byte passes through the store, the host tier or the engine's thread; the
engine's next step finds them like any device hit.

A lent block's checksum is not read by default: its bytes never left this host's
memory (the store checked them when they came in, like the host tier's own), and
the lend keeps them in place while they are copied (a copy that ends too close to
the lend's end is not used). With `verify_pool` (--kv-verify-lent-blocks) every
checksum is checked while the copy runs."""

from __future__ import annotations

import asyncio
import logging
import time

from engine.store_memory import StoreMemory
from services.common import metrics
from services.common.kv_checksum import block_checksum
from services.worker.shared_kv_link import SharedKvLink

logger = logging.getLogger("services.worker.shared_kv")
_LEND_MARGIN = 1.0  # seconds: a lent block copied later than its lend minus this is not used


class LentBlocks:
    def __init__(self, link: SharedKvLink, verify_pool=None):
        self.link = link
        self.verify_pool = verify_pool  # None: checksums are not read
        # the store's memory tier mapped here; None: not (yet) mapped, or another host
        self.memory: StoreMemory | None = None
        self._copying = 0  # copies out of `memory` in flight
        self._mapping: asyncio.Task | None = None

    @property
    def mapped(self) -> bool:
        return self.memory is not None

    async def introduce(self) -> None:
        """Maps the store's region (a Lend of no blocks names it) in the background:
        pinning many GiB for the GPU takes seconds, and until it is done the blocks
        come through the host tier (`yinian:kv_store_memory_mapped` says when)."""
        region, _, _ = await self.link.client.lend("", self.link.block_bytes, [])
        if region is not None:
            self._map_later(region)

    def _map_later(self, region: tuple[str, int]) -> None:
        """Maps `region` in the background, unless a mapping is under way already."""
        if self._mapping is None or self._mapping.done():
            self._mapping = asyncio.get_running_loop().create_task(self.map(region))

    async def map(self, region: tuple[str, int]) -> None:
        """Maps (and on CUDA pins) the store's region, in a thread; the old one goes."""
        cuda = self.link.engine.facts.device.type == "cuda"
        try:
            mapped = await asyncio.to_thread(
                StoreMemory, region[0], region[1], self.link.block_bytes, cuda
            )
        except OSError as exc:
            logger.info("the KV store's memory is not mapped here (%s): its blocks come "
                        "through the host tier", exc)  # fmt: skip
            return
        old, self.memory = self.memory, mapped
        metrics.KV_STORE_MEMORY_MAPPED.labels(worker=self.link.worker_id).set(1)
        while old is not None and self._copying:  # the old one is unmapped once unread
            await asyncio.sleep(0.01)
        if old is not None:
            await asyncio.to_thread(old.close)  # unpinning GiB takes a while too
        logger.info("mapped the KV store's memory tier %s (%.1f GiB, pinned: %s)",
                    region[0], region[1] / (1 << 30), mapped.pinned)  # fmt: skip

    async def fetch(self, hashes: list[int], local: int, tenant: str) -> int:
        """The blocks after `local` that the store lends, copied from its memory into
        device blocks held for them (a prefix continues on the device: none when
        part of `local` is in the host tier); how many were filled."""
        if local >= len(hashes) or self.link.engine.peek_device_prefix(hashes[:local]) < local:
            return 0
        times = [time.monotonic()]
        region, blocks, seconds = await self.link.client.lend(
            tenant, self.link.block_bytes, hashes[local:]
        )
        if region is None or not blocks:
            return 0
        if (str(self.memory.path), self.memory.size) != region:  # the store started again
            self._map_later(region)
            return 0
        deadline = times[0] + seconds
        times.append(time.monotonic())
        ids = await self.link.engine.import_device_begin(hashes[: local + len(blocks)], local)
        blocks, held = blocks[: len(ids)], hashes[local : local + len(ids)]
        times.append(time.monotonic())
        self._copying += 1
        work = asyncio.ensure_future(
            asyncio.to_thread(self._copy, blocks, ids, hashes, local, deadline)
        )
        filled, phases = 0, (0.0, 0.0, 0.0)
        try:
            filled, phases = await asyncio.shield(work)
        except asyncio.CancelledError:
            await asyncio.wait([work])  # no block may be let go under its copy
            raise
        except Exception:
            logger.exception("copying lent blocks failed; recomputing them")
        finally:
            self._copying -= 1
            times.append(time.monotonic())
            await self.link.engine.import_device_end(ids, held, filled)
        times.append(time.monotonic())
        for block_hash in held[:filled]:
            self.link.remember(block_hash)
        ms = [1e3 * (b - a) for a, b in zip(times, times[1:])]
        logger.info("lent %d of %d blocks (%.0f MiB) in %.1f ms: lend %.1f, hold %.1f, copy %.1f "
                    "(issue %.1f, verify %.1f, wait %.1f), commit %.1f", filled, len(ids),
                    filled * self.link.block_bytes / (1 << 20), 1e3 * (times[-1] - times[0]),
                    ms[0], ms[1], ms[2], *phases, ms[3])  # fmt: skip
        return filled

    def _copy(self, blocks, ids: list[int], hashes: list[int], local: int, deadline: float):
        """Copies lent blocks into device blocks `ids` and checks them (in a thread):
        how many leading ones fit the prompt (and hold what their checksum says, if
        verified), and the ms spent issuing the copies, verifying, and waiting."""
        if not ids:
            return 0, (0.0, 0.0, 0.0)
        facts, memory, size = self.link.engine.facts, self.memory, self.link.block_bytes
        try:
            if any(o % size for o, _, _ in blocks):
                raise ValueError("a block between slots")
            raw = [memory.view(o, size) for o, _, _ in blocks]
        except ValueError as exc:
            logger.warning("the KV store lent a block outside its slots (%s); recomputing", exc)
            return 0, (0.0, 0.0, 0.0)
        times = [time.monotonic()]
        # checked while the copies are issued and run: both read the same lent memory
        pool = self.verify_pool
        checks = [pool.submit(block_checksum, r.numpy()) for r in raw] if pool else []
        rows = [r.view(facts.kv_dtype).view(facts.num_layers, *facts.kv_block_shape) for r in raw]
        wait = self.link.engine.copy_into_blocks(rows, ids)
        times.append(time.monotonic())
        try:
            sums = [c.result() for c in checks] if pool else None
            times.append(time.monotonic())
        finally:
            wait()
        times.append(time.monotonic())
        phases = tuple(1e3 * (b - a) for a, b in zip(times, times[1:]))
        if time.monotonic() > deadline - _LEND_MARGIN:
            logger.warning("lent blocks copied too late to trust; recomputing them")
            return 0, phases
        for n, (_, parent, checksum) in enumerate(blocks):
            i = local + n
            damaged = sums is not None and sums[n] != checksum
            if parent != (hashes[i - 1] if i > 0 else 0) or damaged:
                self.link.rejected(hashes[i])
                return n, phases
        return len(blocks), phases
