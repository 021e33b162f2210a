"""The scheduler's gRPC servicer: decode, call the registry and placement, encode."""

from __future__ import annotations

import logging

from opentelemetry import trace

from proto.yinian.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common import mesh_token, metrics
from services.common.kv_index import GPU, HOST, SHARED, KvIndex, check_block_count
from services.common.placement import PlacementPolicy, place
from services.common.placement_outcomes import Outcomes, answer, settings_of
from services.common.registry import Registry, WorkerState
from services.common.telemetry import context_from_grpc, tracer

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
        self.outcomes = Outcomes(metrics.PLACEMENTS, metrics.PLACED_PREFIX_BLOCKS)

    async def Register(self, request, context):
        if not request.worker_id or not request.address:
            raise ValueError("a worker needs a worker_id and an address")
        await mesh_token.only_itself(context, request.worker_id, "worker")
        state = WorkerState.from_info(request)
        self.registry.register(state)  # a restart: the index forgets its old cache
        logger.info("registered %s (%s) at %s", state.worker_id, state.role, state.address)
        return scheduler_pb2.RegisterResponse(
            heartbeat_interval_seconds=self.heartbeat_interval, nats_subject_prefix="yinian"
        )

    async def Deregister(self, request, context):
        await mesh_token.only_itself(context, request.worker_id, "worker")
        if self.registry.deregister(request.worker_id):  # and the index forgets it
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
                self.outcomes.failed(exc)
                span.set_attribute("yinian.placement_error", str(exc))
                raise
            self.outcomes.placed(decision, request.block_size)
            if decision.refused_prefills and decision.prefill is None:
                span.set_attribute("yinian.prefill_refused", "KV layouts differ")
            span.set_attribute("yinian.worker_id", decision.worker.worker_id)
            span.set_attribute("yinian.matched_blocks", decision.matched_blocks)
            out = answer(decision)
            if decision.prefill is not None:
                span.set_attribute("yinian.prefill_worker_id", decision.prefill.worker_id)
            return out

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
        out = scheduler_pb2.ListWorkersResponse(
            placement=settings_of(self.policy, self.registry.heartbeat_timeout)
        )
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
