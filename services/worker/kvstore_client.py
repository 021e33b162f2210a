"""A worker's calls to the KV store (services/kvstore): lookup, get and put of
whole blocks under the worker's model fingerprint. The shared tier is an
accelerator, never a dependency: every failure is a miss or a skipped write
(counted), and a store that failed is left alone for a few seconds."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing

import grpc

from proto.yinian.v1 import kvstore_pb2, kvstore_pb2_grpc
from services.common.channels import OPTIONS
from services.common.grpc_streams import read_stream
from services.common.kv_checksum import block_checksum
from services.common.telemetry import grpc_metadata
from services.common.tls import TlsFiles, aio_channel

logger = logging.getLogger(__name__)
# the store cannot map our region (another host), or predates the same-host RPCs
_NO_REGION = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED)
FORMAT_VERSION = 2  # of a block: every layer's block, one after another; XXH3-64 checksums


def fingerprint(
    model_id: str, dtype: str, block_size: int, layout: str, num_layers: int
) -> kvstore_pb2.ModelFingerprint:
    return kvstore_pb2.ModelFingerprint(
        model_id=model_id,
        dtype=dtype,
        block_size=block_size,
        layout=layout,
        num_layers=num_layers,
        format_version=FORMAT_VERSION,
    )


class KvStoreClient:
    def __init__(
        self,
        address: str,
        model: kvstore_pb2.ModelFingerprint,
        timeout: float = 5.0,
        backoff: float = 3.0,
        tls: TlsFiles | None = None,
    ):
        self.address = address
        self.model = model
        self.timeout = timeout
        self.backoff = backoff
        self.channel = aio_channel(address, tls, OPTIONS)
        self.stub = kvstore_pb2_grpc.KvStoreStub(self.channel)
        self._down_until = 0.0
        self.failures = 0

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, exc: Exception) -> None:
        self.failures += 1
        self._down_until = time.monotonic() + self.backoff
        logger.warning("KV store %s %s failed (%s); not asking for %.0f s",
                       self.address, what, exc, self.backoff)  # fmt: skip

    async def lookup(self, tenant: str, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` the shared tier holds (0 on failure)."""
        if not hashes or not self.available:
            return 0
        try:
            request = kvstore_pb2.LookupRequest(
                tenant=tenant, fingerprint=self.model, block_hashes=hashes
            )
            answer = await self.stub.Lookup(request, timeout=self.timeout, metadata=grpc_metadata())
        except grpc.RpcError as exc:
            self._failed("lookup", exc)
            return 0
        return answer.shared_prefix_blocks

    async def get(self, tenant: str, hashes: list[int]) -> list[tuple[int, int, bytes]]:
        """(hash, parent hash, bytes) of the leading blocks the store returned, each
        checked again here (in a thread): its checksum, and that it is the block
        asked for."""
        if not hashes or not self.available:
            return []
        received = []
        request = kvstore_pb2.GetRequest(tenant=tenant, fingerprint=self.model, block_hashes=hashes)
        try:
            call = self.stub.Get(request, timeout=self.timeout, metadata=grpc_metadata())
            async with aclosing(read_stream(call)) as blocks:
                async for block in blocks:
                    received.append(block)
                    if len(received) == len(hashes):
                        break
        except grpc.RpcError as exc:
            self._failed("get", exc)
        return await asyncio.to_thread(_verified, received, hashes)

    async def put(self, tenant: str, blocks: list[tuple[int, int, bytes, int]]) -> int:
        """Stores (hash, parent hash, bytes, checksum) blocks; returns how many are
        now there."""
        if not blocks or not self.available:
            return 0

        def messages():
            for block_hash, parent, data, checksum in blocks:
                yield kvstore_pb2.PutBlock(
                    tenant=tenant,
                    fingerprint=self.model,
                    block_hash=block_hash,
                    parent_hash=parent,
                    data=data,
                    checksum=checksum,
                )

        try:
            answer = await self.stub.Put(
                messages(), timeout=self.timeout * 4, metadata=grpc_metadata()
            )
        except grpc.RpcError as exc:
            self._failed("put", exc)
            return 0
        return answer.stored + answer.already_present

    # -- the same-host data plane: the store reads and fills our host tier itself --
    async def put_from(
        self, tenant: str, region: tuple[str, int], block_bytes: int,
        blocks: list[tuple[int, int, int]],
    ) -> int | None:  # fmt: skip
        """Stores (hash, parent hash, offset) blocks that the store reads out of
        `region` (path, size); how many are now there, or None when the store
        cannot open the region (another host)."""
        if not blocks or not self.available:
            return 0
        request = kvstore_pb2.PutFromRequest(
            tenant=tenant,
            fingerprint=self.model,
            region=_region(region),
            block_bytes=block_bytes,
            blocks=[
                kvstore_pb2.RegionBlock(block_hash=h, parent_hash=p, offset=o) for h, p, o in blocks
            ],
        )
        try:
            answer = await self.stub.PutFrom(
                request, timeout=self.timeout * 4, metadata=grpc_metadata()
            )
        except grpc.RpcError as exc:
            if _cannot_map(exc):
                return None
            self._failed("put", exc)
            return 0
        return answer.stored + answer.already_present

    async def map_region(self, region: tuple[str, int], block_bytes: int) -> bool | None:
        """Has the store map `region` (a GetInto of no blocks): True, or None when it
        cannot open it, False when the store is unreachable."""
        try:
            await self.stub.GetInto(
                kvstore_pb2.GetIntoRequest(fingerprint=self.model, region=_region(region),
                                           block_bytes=block_bytes),
                timeout=self.timeout, metadata=grpc_metadata(),
            )  # fmt: skip
        except grpc.RpcError as exc:
            if _cannot_map(exc):
                return None
            return False
        return True

    async def get_into(
        self, tenant: str, region: tuple[str, int], block_bytes: int,
        hashes: list[int], offsets: list[int],
    ) -> list[tuple[int, int]] | None:  # fmt: skip
        """The store writes the leading blocks it has into `region` at `offsets`;
        (parent hash, checksum) of each written, or None when it cannot open the
        region. The caller verifies the checksums over its own memory."""
        if not hashes or not self.available:
            return []
        request = kvstore_pb2.GetIntoRequest(
            tenant=tenant,
            fingerprint=self.model,
            region=_region(region),
            block_bytes=block_bytes,
            block_hashes=hashes,
            offsets=offsets,
        )
        try:
            answer = await self.stub.GetInto(
                request, timeout=self.timeout, metadata=grpc_metadata()
            )
        except grpc.RpcError as exc:
            if _cannot_map(exc):
                return None
            self._failed("get", exc)
            return []
        return list(zip(answer.parent_hashes, answer.checksums))

    async def lend(
        self, tenant: str, block_bytes: int, hashes: list[int]
    ) -> tuple[tuple[str, int] | None, list[tuple[int, int, int]], float]:
        """(the store's region (path, size) or None, [(offset, parent hash, checksum)]
        of the leading blocks it lent, seconds they stay put). No region: the store
        cannot lend (private memory, another block size, unreachable)."""
        if not self.available:
            return None, [], 0.0
        request = kvstore_pb2.LendRequest(
            tenant=tenant, fingerprint=self.model, block_bytes=block_bytes, block_hashes=hashes
        )
        try:
            answer = await self.stub.Lend(request, timeout=self.timeout, metadata=grpc_metadata())
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:  # an older store lends nothing
                self._failed("lend", exc)
            return None, [], 0.0
        if not answer.HasField("region"):
            return None, [], 0.0
        blocks = list(zip(answer.offsets, answer.parent_hashes, answer.checksums))
        return (answer.region.path, answer.region.size), blocks, answer.lease_seconds

    async def close(self) -> None:
        await self.channel.close()


def _cannot_map(exc: grpc.RpcError) -> bool:
    """Whether the store answered that it cannot map our region (and say why)."""
    if exc.code() not in _NO_REGION:
        return False
    logger.info("the KV store cannot map our host tier: %s", exc.details())
    return True


def _region(region: tuple[str, int]) -> kvstore_pb2.SharedRegion:
    return kvstore_pb2.SharedRegion(path=region[0], size=region[1])


def _verified(received, hashes: list[int]) -> list[tuple[int, int, bytes]]:
    out: list[tuple[int, int, bytes]] = []
    for block, want in zip(received, hashes):
        if block.block_hash != want or block_checksum(block.data) != block.checksum:
            logger.warning("KV store sent a block that fails verification; dropped")
            break
        out.append((block.block_hash, block.parent_hash, block.data))
    return out
