"""A worker's expert control plane (asyncio, beside the engine thread): polls
the scheduler's expert balancer for the placement, forms the data-path group
with its members (hands each over gRPC `Join` its mailbox, where every
member can map one (`transport` auto or shared), its stream-ordered buffers
(`stream`), else the rendezvous of a collective group), installs
group and placement in the engine's `RemoteExperts` (switched at the next
step boundary), and answers a failed group: members that do not answer a
health check are reported lost, and a group of the others is formed at once
with their slots only (`fallback`: "replicas" keeps the surviving replicas of
the lost member's experts, "local" computes those experts in the worker),
until the balancer's repaired placement arrives."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from basis.model_config import ModelConfig
from proto.yinian.v1 import expert_pb2, expert_pb2_grpc
from services.common.channels import OPTIONS, WorkerChannels
from services.common.telemetry import tracer
from services.common.tls import aio_channel
from services.expert_parallel import FALLBACKS, TRANSPORTS
from services.expert_parallel.group import ExpertGroup, Rendezvous, model_tag
from services.expert_parallel.mailbox import MailboxPort
from services.expert_parallel.placement import Placement
from services.expert_parallel.remote import RemoteExperts
from services.expert_parallel.stream_port import StreamPort

logger = logging.getLogger(__name__)


class ExpertControl:
    def __init__(self, engine, model: str, worker_id: str, balancer: str, host: str,
                 fallback: str = "replicas", timeout: float = 5.0, poll_interval: float = 0.25,
                 tls=None, transport: str = "auto"):  # fmt: skip
        if fallback not in FALLBACKS:
            raise ValueError(f"expert fallback must be one of {FALLBACKS}, got {fallback!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"expert transport must be one of {TRANSPORTS}, got {transport!r}")
        config = ModelConfig.from_pretrained(model)
        if not config.is_moe:
            raise ValueError(f"{model} has no MoE layers to serve from expert services")
        self.engine, self.worker_id, self.host = engine, worker_id, host
        self.fallback, self.timeout, self.poll_interval = fallback, timeout, poll_interval
        self.transport = transport
        self.tag, self.hidden = model_tag(model), config.hidden_size
        self.top_k = config.num_experts_per_tok
        facts = engine.facts
        ranks = getattr(facts, "tensor_parallel_size", 1) * getattr(
            facts, "pipeline_parallel_size", 1
        )
        if ranks > 1:  # each rank would hold a slice of every expert
            raise ValueError("expert services need an engine of one rank (no tensor or "
                             "pipeline parallelism)")  # fmt: skip
        self.device, self.dtype = facts.device, facts.kv_dtype
        self.capacity = getattr(facts, "max_num_batched_tokens", 8192)  # tokens a dispatch
        self.backend_name = "nccl" if self.device.type == "cuda" else "gloo"
        self._failed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.experts = RemoteExperts(worker_id, sorted(config.moe_layers), self._on_failure,
                                     tracer("yinian.experts"))  # fmt: skip
        self._balancer = aio_channel(balancer, tls, OPTIONS)
        self.channels = WorkerChannels(tls)
        self.installed: Placement | None = None
        self.group: ExpertGroup | None = None
        self._last_error = ""

    def _on_failure(self) -> None:  # the engine thread
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._failed.set)

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.engine.set_expert_backend(self.experts)
        stub = expert_pb2_grpc.ExpertBalancerStub(self._balancer)
        while True:
            try:
                request = expert_pb2.PlacementRequest(
                    worker_id=self.worker_id, applied_version=self.experts.applied_version
                )
                placement = Placement.from_message(await stub.GetPlacement(request, timeout=2.0))
                if self._failed.is_set():
                    self._failed.clear()
                    await self._recover(stub, placement)
                elif self.installed is None or placement.version != self.installed.version:
                    await self._install(placement)
            except (grpc.RpcError, ValueError, RuntimeError, TimeoutError) as exc:
                why = str(exc)[:200]
                if why != self._last_error:  # once per distinct reason, not every poll
                    logger.warning("expert placement not updated: %s", why)
                self._last_error = why
            else:
                self._last_error = ""
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._failed.wait(), timeout=self.poll_interval)

    async def _install(self, placement: Placement) -> None:
        if placement.version > 0 and placement.model and placement.model != self.tag:
            raise ValueError(f"the balancer places {placement.model}, this worker serves "
                             f"{self.tag}")  # fmt: skip
        group = None
        if placement.members:
            ids = tuple(m.expert_id for m in placement.members)
            reusable = self.group is not None and not self.group.closed
            if reusable and self.group.member_ids == ids and not self.experts.broken:
                group = self.group
            else:
                group = await self._form(placement)
        self.experts.install(group, placement)
        self.group, self.installed = group, placement
        logger.info("expert placement %d over %d services installed", placement.version,
                    len(placement.members))  # fmt: skip

    async def _form(self, placement: Placement) -> ExpertGroup:
        if self.transport == "stream":
            return await self._form_mapped(placement, "stream", lambda n: StreamPort(
                n, self.dtype, self.hidden, self.top_k, self.device, self.timeout,
                self.capacity))  # fmt: skip
        if self.transport != "collective":
            try:
                return await self._form_shared(placement)
            except RuntimeError as exc:
                if self.transport == "shared":
                    raise
                logger.info("expert services over collectives: %s", str(exc)[:200])
        return await self._form_collective(placement)

    async def _join_all(self, members, request_of) -> dict[str, BaseException]:
        """Join on every member at once; those that refused, with why."""
        joins = [
            self.channels.stub(m.address, expert_pb2_grpc.ExpertStub).Join(
                request_of(rank), timeout=self.timeout
            )
            for rank, m in enumerate(members, start=1)
        ]
        results = await asyncio.gather(*joins, return_exceptions=True)
        return {m.expert_id: r for m, r in zip(members, results) if isinstance(r, BaseException)}

    def _join_request(self, rank: int, world: int, **fields) -> expert_pb2.JoinRequest:
        return expert_pb2.JoinRequest(
            rank=rank, world_size=world, dtype=str(self.dtype).removeprefix("torch."),
            hidden_size=self.hidden, model=self.tag, timeout_seconds=self.timeout, **fields,
        )  # fmt: skip

    async def _form_shared(self, placement: Placement) -> ExpertGroup:
        """Every member maps a mailbox this worker makes (same host), or none does."""
        return await self._form_mapped(placement, "shared", lambda n: MailboxPort(
            n, self.dtype, self.hidden, self.device, self.timeout))  # fmt: skip

    async def _form_mapped(self, placement: Placement, backend: str, make) -> ExpertGroup:
        """A group over buffers this worker makes (`make(members)`) and every member
        maps in its Join, or none does."""
        members = placement.members
        port = await asyncio.to_thread(make, len(members))
        group_id = uuid.uuid4().hex[:12]
        refused = await self._join_all(members, lambda rank: self._join_request(
            rank, len(members) + 1, group_id=group_id, backend=backend,
            mailbox=port.description(rank)))  # fmt: skip
        if refused:
            port.close()  # the members that did map theirs see it closed and stop
            first = next(iter(refused.values()))
            raise RuntimeError(f"expert services {sorted(refused)} cannot map this worker's "
                               f"mailboxes: {first!r}"[:300])  # fmt: skip
        return ExpertGroup.shared(members, port)

    async def _form_collective(self, placement: Placement) -> ExpertGroup:
        members = placement.members
        rendezvous = Rendezvous.open(self.host, len(members) + 1, self.backend_name, self.timeout)
        forming = asyncio.create_task(asyncio.to_thread(
            ExpertGroup.form, rendezvous, members, self.timeout, self.device))  # fmt: skip
        refused = await self._join_all(members, lambda rank: self._join_request(
            rank, len(members) + 1, group_id=rendezvous.group_id, store_host=self.host,
            store_port=rendezvous.port, backend=self.backend_name))  # fmt: skip
        if refused:
            # The group cannot form; when the thread's wait ends, drop what it made.
            forming.add_done_callback(lambda t: t.exception() or t.result().close(False))
            first = next(iter(refused.values()))
            raise RuntimeError(f"expert services {sorted(refused)} did not join: {first!r}"[:300])
        return await forming

    async def _recover(self, stub, placement: Placement) -> None:
        """The group failed: drop unreachable members, carry on with the others."""
        current = self.installed or placement
        alive = await asyncio.gather(*(self._alive(m.address) for m in current.members))
        lost = {m.expert_id for m, ok in zip(current.members, alive) if not ok}
        if lost:
            logger.warning("expert services %s unreachable; reporting them", sorted(lost))
            reply = await stub.ReportLost(
                expert_pb2.LostExperts(worker_id=self.worker_id, expert_ids=sorted(lost)),
                timeout=5.0,
            )
            placement = Placement.from_message(reply)
            if {m.expert_id for m in placement.members} & lost:
                placement = placement.without(lost, keep_replicas=self.fallback == "replicas")
        self.group = None  # the failed one is aborted
        await self._install(placement)

    async def _alive(self, address: str) -> bool:
        channel = self.channels.channel(address)
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=1.0
            )
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    async def close(self, graceful: bool = False) -> None:
        """Graceful (tell the members this group is done, so each ends its serving
        loop at once) only once the engine has stopped stepping: the leave is a
        collective its thread would otherwise race. A worker process that exits
        closes its connections, which ends the members' loops as well."""
        if self.group is not None:
            self.group.close(graceful=graceful)
        await self.channels.close()
        await self._balancer.close()
