"""The KV store's gRPC servicer: decode, call the store, encode."""

from __future__ import annotations

from opentelemetry import trace

from proto.yinian.v1 import kvstore_pb2, kvstore_pb2_grpc
from services.common.errors import InvalidRequest
from services.common.grpc_streams import answer_at_once
from services.common.kv_index import SHARED
from services.common.telemetry import context_from_grpc, tracer
from services.kvstore import same_host
from services.kvstore.fingerprint import Fingerprint
from services.kvstore.regions import Regions
from services.kvstore.store import KvStore

_tracer = tracer("yinian.kvstore")
_TIERS = {SHARED: kvstore_pb2.KV_TIER_SHARED}  # Lookup answers for the shared tier alone


def fingerprint_of(message) -> Fingerprint:
    if not message.HasField("fingerprint"):
        raise InvalidRequest("a model fingerprint is required")
    f = message.fingerprint
    return Fingerprint(
        f.model_id, f.dtype, f.block_size, f.layout, f.num_layers, f.format_version
    )  # its checks raise ValueError -> INVALID_ARGUMENT


def _span(name: str, context, tenant: str, blocks: int = 0):
    return _tracer.start_as_current_span(
        name,
        context=context_from_grpc(context),
        kind=trace.SpanKind.SERVER,
        attributes={"yinian.tenant": tenant, "yinian.blocks": blocks},
    )


def region_of(request) -> same_host.Region:
    if not request.HasField("region") or not request.region.path:
        raise InvalidRequest("a shared region is required")
    return same_host.Region(request.region.path, request.region.size, request.block_bytes)


def _tally(out: kvstore_pb2.PutResponse, block_hash: int, outcome) -> None:
    if outcome.status == "stored":
        out.stored += 1
    elif outcome.status == "present":
        out.already_present += 1
    else:
        out.rejected += 1
        out.reasons.append(f"{block_hash:016x}: {outcome.detail}")
        out.rejected_hashes.append(block_hash)


class KvStoreServicer(kvstore_pb2_grpc.KvStoreServicer):
    def __init__(self, store: KvStore, regions: Regions | None = None):
        self.store = store
        self.regions = regions or Regions()

    async def Lookup(self, request, context):
        with _span("kvstore.lookup", context, request.tenant, len(request.block_hashes)) as span:
            result = await self.store.lookup(
                request.tenant, fingerprint_of(request), request.block_hashes
            )
            span.set_attribute("yinian.matched_blocks", len(result.locations))
            span.set_attribute("yinian.shared_prefix_blocks", result.shared_prefix_blocks)
            return kvstore_pb2.LookupResponse(
                locations=[
                    kvstore_pb2.BlockLocation(
                        block_hash=loc.block_hash,
                        holders=[
                            kvstore_pb2.BlockHolder(holder=holder, tier=_TIERS[tier])
                            for holder, tier in loc.holders
                        ],
                    )
                    for loc in result.locations
                ],
                shared_prefix_blocks=result.shared_prefix_blocks,
            )

    async def Put(self, request_iterator, context):
        with _span("kvstore.put", context, "") as span:
            out = kvstore_pb2.PutResponse()
            async for block in request_iterator:
                outcome = await self.store.put(
                    block.tenant,
                    fingerprint_of(block),
                    block.block_hash,
                    block.parent_hash,
                    block.data,
                    block.checksum,
                )
                _tally(out, block.block_hash, outcome)
                span.set_attribute("yinian.tenant", block.tenant)
            span.set_attribute("yinian.stored_blocks", out.stored)
            span.set_attribute("yinian.rejected_blocks", out.rejected)
            return out

    async def Get(self, request, context):
        await answer_at_once(context)
        fingerprint = fingerprint_of(request)
        # Not made current: a streaming handler resumes between yields.
        span = _tracer.start_span(
            "kvstore.get",
            context=context_from_grpc(context),
            kind=trace.SpanKind.SERVER,
            attributes={
                "yinian.tenant": request.tenant,
                "yinian.blocks": len(request.block_hashes),
            },
        )
        served = 0
        try:
            async for block in self.store.get(request.tenant, fingerprint, request.block_hashes):
                served += 1
                yield kvstore_pb2.StoredBlock(
                    block_hash=block.block_hash,
                    parent_hash=block.parent_hash,
                    data=block.payload,
                    checksum=block.checksum,
                )
        finally:
            span.set_attribute("yinian.served_blocks", served)
            span.end()

    async def PutFrom(self, request, context):
        with _span("kvstore.put_from", context, request.tenant, len(request.blocks)) as span:
            blocks = [(b.block_hash, b.parent_hash, b.offset) for b in request.blocks]
            results = await same_host.put_from(
                self.store, self.regions, request.tenant, fingerprint_of(request),
                region_of(request), blocks, context.time_remaining,
            )  # fmt: skip
            out = kvstore_pb2.PutResponse()
            for block_hash, outcome in results:
                _tally(out, block_hash, outcome)
            span.set_attribute("yinian.stored_blocks", out.stored)
            return out

    async def GetInto(self, request, context):
        with _span("kvstore.get_into", context, request.tenant, len(request.block_hashes)) as span:
            written = await same_host.get_into(
                self.store, self.regions, request.tenant, fingerprint_of(request),
                region_of(request), list(request.block_hashes), list(request.offsets),
                context.time_remaining,
            )  # fmt: skip
            span.set_attribute("yinian.served_blocks", len(written))
            return kvstore_pb2.GetIntoResponse(
                parent_hashes=[p for p, _ in written], checksums=[c for _, c in written]
            )

    async def Lend(self, request, context):
        with _span("kvstore.lend", context, request.tenant, len(request.block_hashes)) as span:
            lent = await self.store.lend(
                request.tenant, fingerprint_of(request), request.block_bytes,
                list(request.block_hashes),
            )  # fmt: skip
            span.set_attribute("yinian.served_blocks", len(lent.blocks))
            if lent.region is None:
                return kvstore_pb2.LendResponse()
            return kvstore_pb2.LendResponse(
                region=kvstore_pb2.SharedRegion(path=lent.region[0], size=lent.region[1]),
                offsets=[o for o, _, _ in lent.blocks],
                parent_hashes=[p for _, p, _ in lent.blocks],
                checksums=[c for _, _, c in lent.blocks],
                lease_seconds=lent.seconds,
            )

    async def Stats(self, request, context):
        tenant = request.tenant if request.HasField("tenant") else None
        report = await self.store.stats(tenant)
        mean, p99 = report.redis_latency_ms
        return kvstore_pb2.StatsResponse(
            tenants=[
                kvstore_pb2.TenantStats(
                    tenant=t.tenant,
                    blocks=t.blocks,
                    bytes=t.bytes,
                    quota_bytes=t.quota_bytes,
                    hit_blocks=t.counters.hit_blocks,
                    miss_blocks=t.counters.miss_blocks,
                    hit_tokens=t.counters.hit_tokens,
                    miss_tokens=t.counters.miss_tokens,
                    get_blocks=t.counters.get_blocks,
                    get_misses=t.counters.get_misses,
                    stored_blocks=t.counters.stored_blocks,
                    evictions=t.counters.evictions,
                    verification_failures=t.counters.verification_failures,
                    rejected_puts=t.counters.rejected_puts,
                )
                for t in report.tenants
            ],
            shared_tier_enabled=report.shared_tier_enabled,
            redis_up=report.redis_up,
            shared_blocks=report.shared_blocks,
            shared_bytes=report.shared_bytes,
            capacity_bytes=report.capacity_bytes,
            redis_errors=report.redis_errors,
            redis_latency_mean_ms=mean,
            redis_latency_p99_ms=p99,
        )
