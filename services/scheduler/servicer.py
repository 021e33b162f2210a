"""The scheduler's gRPC servicer: decode, call the registry and placement, encode."""

from __future__ import annotations

import logging

from opentelemetry import trace

from proto.yinian.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common import mesh_token, metrics
from services.common.kv_index import GPU, HOST, SHARED, KvIndex, check_block_count
from services.common.telemetry import context_from_grpc, tracer
from services.scheduler.placement import PlacementPolicy, place
from services.scheduler.registry import Registry, WorkerState

logger = logging.getLogger(__name__)
_tracer = tracer("yinian.scheduler")


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(
        self, registry: Registry, index: KvIndex, policy: PlacementPolicy, heartbeat_interval: float
    ):
        self.registry = registry
        self.index = index
        self.policy = policy
        self.heartbeat_interval = heartbeat_interval
        self._mismatches: set[tuple[int, int]] = set()  # (gateway's, worker's) block sizes said

    async def Register(self, request, context):
        if not request.worker_id or not request.address:
            raise ValueError("a worker needs a worker_id and an address")
        await mesh_token.only_itself(context, request.worker_id, "worker")
        state = WorkerState(
            worker_id=request.worker_id,
            address=request.address,
            role=request.role or "colocated",
            block_size=request.block_size or 16,
            max_num_seqs=request.max_num_seqs or 256,
            kv_blocks_total=request.kv_blocks_total,
            host=request.host,
            transports=list(request.transports),
            metrics_address=request.metrics_address,
            model=request.model,
            kv_layout=request.kv_layout,
            parallel=request.tensor_parallel_size * request.pipeline_parallel_size > 1,
            info=request,
        )
        if self.registry.register(state):
            self.index.forget(state.worker_id)  # a restart: its old cache is gone
        logger.info("registered %s (%s) at %s", state.worker_id, state.role, state.address)
        return scheduler_pb2.RegisterResponse(
            heartbeat_interval_seconds=self.heartbeat_interval, nats_subject_prefix="yinian"
        )

    async def Deregister(self, request, context):
        await mesh_token.only_itself(context, request.worker_id, "worker")
        if self.registry.deregister(request.worker_id):
            self.index.forget(request.worker_id)
            logger.info("deregistered %s", request.worker_id)
        return scheduler_pb2.DeregisterResponse()

    async def Place(self, request, context):
        with _tracer.start_as_current_span(
            "scheduler.place",
            context=context_from_grpc(context),
            kind=trace.SpanKind.SERVER,
            attributes={
                "yinian.request_id": request.request_id,
                "gen_ai.usage.input_tokens": request.prompt_tokens,
            },
        ) as span:
            try:
                decision = place(
                    self.registry,
                    self.index,
                    self.policy,
                    list(request.block_hashes),
                    request.prompt_tokens,
                    exclude=set(request.exclude_workers),
                )
            except Exception as exc:
                metrics.PLACEMENTS.labels(outcome=type(exc).__name__).inc()
                span.set_attribute("yinian.placement_error", str(exc))
                raise
            metrics.PLACEMENTS.labels(outcome="placed").inc()
            metrics.PLACED_PREFIX_BLOCKS.labels(kind="chosen").inc(decision.matched_blocks)
            metrics.PLACED_PREFIX_BLOCKS.labels(kind="longest").inc(decision.longest_blocks)
            if request.block_size and request.block_size != decision.worker.block_size:
                self._block_size_mismatch(request.block_size, decision.worker)
            if decision.refused_prefills and decision.prefill is None:
                metrics.PLACEMENTS.labels(outcome="prefill_layout_mismatch").inc()
                span.set_attribute("yinian.prefill_refused", "KV layouts differ")
            span.set_attribute("yinian.worker_id", decision.worker.worker_id)
            span.set_attribute("yinian.matched_blocks", decision.matched_blocks)
            out = scheduler_pb2.Placement(
                worker_id=decision.worker.worker_id,
                address=decision.worker.address,
                matched_blocks=decision.matched_blocks,
            )
            if decision.prefill is not None:
                out.prefill_worker_id = decision.prefill.worker_id
                out.prefill_address = decision.prefill.address
                span.set_attribute("yinian.prefill_worker_id", decision.prefill.worker_id)
            return out

    def _block_size_mismatch(self, asked: int, worker) -> None:
        """The gateway hashed the prompt in blocks of another size than the worker's:
        no prefix can match (prefix-aware placement is off in all but name). Counted
        every time, said once per pair of sizes."""
        metrics.PLACEMENTS.labels(outcome="block_size_mismatch").inc()
        if (asked, worker.block_size) not in self._mismatches:
            self._mismatches.add((asked, worker.block_size))
            logger.warning(
                "the gateway hashes prompts in blocks of %d tokens, worker %s caches blocks "
                "of %d: no cached prefix can be found; give the gateway --block-size %d",
                asked, worker.worker_id, worker.block_size, worker.block_size,
            )  # fmt: skip

    async def Holders(self, request, context):
        """Who holds each leading block of a prompt, from the mesh's one KV index."""
        hashes = request.block_hashes
        check_block_count(hashes)
        out = scheduler_pb2.HoldersResponse()
        for block_hash in hashes:
            held = self.index.holders(block_hash)
            if not held:
                break
            out.blocks.append(
                scheduler_pb2.BlockHolders(
                    block_hash=block_hash,
                    gpu=sorted(h for h, tier in held if tier == GPU),
                    host=sorted(h for h, tier in held if tier == HOST),
                    shared=any(tier == SHARED for _, tier in held),
                )
            )
        return out

    async def ListWorkers(self, request, context):
        out = scheduler_pb2.ListWorkersResponse()
        now = self.registry.clock()
        for w in self.registry.workers.values():
            out.workers.append(
                scheduler_pb2.WorkerStatus(
                    info=w.info,
                    ready=self.registry.is_ready(w),
                    seconds_since_report=now - w.last_seen,
                    num_requests_running=w.running,
                    num_requests_waiting=w.waiting,
                    kv_cache_usage=w.kv_usage,
                )
            )
        return out
