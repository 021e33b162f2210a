"""The expert service's process: the experts' weights (loaded when the
balancer places experts here), the gRPC server (Join, LoadExperts,
FreeExperts, GetExpertLoad, SetLoadCollection), one serving thread per worker
group, registration with the scheduler's expert balancer, and per-layer load
reports on NATS (also its heartbeat)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
import torch

from basis.model_config import ModelConfig
from proto.yinian.v1 import expert_pb2, expert_pb2_grpc
from services.common import metrics as common_metrics
from services.common.bus import EventBus, expert_load_subject
from services.common.channels import OPTIONS
from services.common.entry import StartupError, stop_on_signals
from services.common.grpc_server import GrpcServer
from services.common.telemetry import setup_tracing, shutdown_tracing
from services.common.tls import aio_channel
from services.expert.config import ExpertConfig
from services.expert.expert_store import ExpertStore
from services.expert.expert_weights import ExpertWeights
from services.expert.servicer import ExpertServicer, load_message
from services.expert.serving import GroupServer
from services.expert_parallel.group import model_tag

logger = logging.getLogger("services.expert")
REREGISTER_SECONDS = 5.0
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_store(config: ExpertConfig) -> tuple[ExpertStore, ModelConfig]:
    try:
        model_config = ModelConfig.from_pretrained(config.model)
        weights = ExpertWeights(config.model, model_config, config.load_format == "dummy")
    except (OSError, ValueError) as exc:
        raise StartupError(f"--model {config.model}: {exc}") from None
    dtype = _DTYPES[model_config.torch_dtype if config.dtype == "auto" else config.dtype]
    device = torch.device(config.device)
    torch.set_num_threads(config.threads)
    if device.type == "cuda":  # the fused MoE kernels (untested in this repository's CI)
        from kernels.cuda_ops import register

        register()
    return ExpertStore(weights, dtype, device), model_config


# answers that trying again cannot change
REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION)  # fmt: skip


async def register(config: ExpertConfig, info: expert_pb2.ExpertServiceInfo,
                   timeout: float = 60.0) -> None:  # fmt: skip
    """Registers with the balancer, retrying until it answers."""
    deadline = asyncio.get_running_loop().time() + timeout
    async with aio_channel(config.scheduler, config.tls_files(), OPTIONS) as channel:
        stub = expert_pb2_grpc.ExpertBalancerStub(channel)
        while True:
            try:
                await stub.RegisterExpert(info, timeout=2.0)
                return
            except grpc.RpcError as exc:
                if exc.code() in REFUSALS:
                    raise StartupError(
                        f"the balancer refused this service: {exc.details()}"
                    ) from None
                if asyncio.get_running_loop().time() > deadline:
                    raise StartupError(f"scheduler {config.scheduler} unreachable") from None
                await asyncio.sleep(0.3)


async def deregister(config: ExpertConfig) -> None:
    with contextlib.suppress(grpc.RpcError):
        async with aio_channel(config.scheduler, config.tls_files(), OPTIONS) as channel:
            await expert_pb2_grpc.ExpertBalancerStub(channel).DeregisterExpert(
                expert_pb2.DeregisterExpertRequest(expert_id=config.expert_id), timeout=1.0
            )


async def report_load(bus: EventBus, store: ExpertStore, config: ExpertConfig,
                      info: expert_pb2.ExpertServiceInfo) -> None:  # fmt: skip
    """Load reports (the heartbeat), and a registration now and then: a restarted
    scheduler, or one that dropped this service while NATS was away, learns of it
    again (registering is idempotent)."""
    subject = expert_load_subject(config.expert_id)
    last_registered = asyncio.get_running_loop().time()
    while True:
        counts = store.take_counts() if store.collecting else None
        await bus.publish(subject, load_message(store, config.expert_id, counts))
        now = asyncio.get_running_loop().time()
        if now - last_registered >= REREGISTER_SECONDS:
            last_registered = now
            with contextlib.suppress(StartupError):
                await register(config, info, timeout=1.0)
        await asyncio.sleep(config.report_interval)


async def run(config: ExpertConfig) -> None:
    setup_tracing("yinian-expert")
    store, model_config = build_store(config)
    tag = model_tag(config.model)
    groups = GroupServer(store, config.expert_id, config.address_host, tag,
                         model_config.hidden_size)  # fmt: skip
    server = GrpcServer(config.host, config.port, config.tls_files())
    server.add(expert_pb2_grpc.add_ExpertServicer_to_server,
               ExpertServicer(store, groups, config.expert_id), ["yinian.v1.Expert"])  # fmt: skip
    await server.start()
    metrics_port = common_metrics.serve_metrics(
        config.metrics_port, config.host, common_metrics.EXPERT
    )
    bus = EventBus(config.nats_url, config.expert_id)
    await bus.connect()
    info = expert_pb2.ExpertServiceInfo(
        expert_id=config.expert_id,
        address=f"{config.address_host}:{server.port}",
        model=tag,
        slots=config.slots,
        host=config.address_host,
        device=str(store.device),
        dtype=groups.dtype_name,
        num_moe_layers=store.num_layers,
        num_experts=store.num_experts,
        hidden_size=model_config.hidden_size,
        metrics_address=f"{config.address_host}:{metrics_port}",
    )
    await register(config, info)
    reports = asyncio.create_task(report_load(bus, store, config, info))
    await server.serving(True)
    print(f"READY expert {config.expert_id} {info.address} metrics {info.metrics_address}",
          flush=True)  # fmt: skip
    stop = stop_on_signals()
    await stop.wait()
    await server.serving(False)
    await deregister(config)
    reports.cancel()
    await asyncio.to_thread(groups.close)
    await server.stop(grace=1.0)
    await bus.close()
    shutdown_tracing()
