"""Test helpers for expert parallelism: a cluster of NATS, the scheduler (its
expert balancer) and N expert services as real processes, and an engine in
the test process acting as the attention worker (its own ExpertControl, as a
worker service has)."""

from __future__ import annotations

import asyncio
import time

from basis.sampling_params import SamplingParams
from engine import AsyncLLM
from proto.yinian.v1 import expert_pb2, expert_pb2_grpc
from services.common.tls import sync_channel
from services.expert_parallel.control import ExpertControl
from yinian.mesh import Mesh, MeshSpec

GREEDY = SamplingParams(max_tokens=12, temperature=0)
PROMPTS = [
    "The quick brown fox",
    "Hello",
    "Experts of a mixture",
    "one two three four five six seven",
    "a",
    "The mesh and its services, each on its own",
]


def expert_cluster(model: str, experts: int, scheduler_argv=(), expert_argv=()) -> Mesh:
    """NATS, the scheduler and `experts` expert services; no worker, no gateway."""
    spec = MeshSpec(model=model, workers=0, experts=experts, gateways=0, port=0,
                    scheduler_argv=list(scheduler_argv), expert_argv=list(expert_argv))  # fmt: skip
    return Mesh(spec).start(timeout=120)


def balancer(mesh: Mesh) -> expert_pb2_grpc.ExpertBalancerStub:
    return expert_pb2_grpc.ExpertBalancerStub(sync_channel(mesh.scheduler_address, None))


def wait_for_placement(mesh: Mesh, members: int, timeout: float = 60.0) -> expert_pb2.ExpertStatus:
    """The placement over `members` services. The first placement is made once
    registrations pause; services that registered after it get slots at the next
    rebalance, asked for here."""
    stub, deadline = balancer(mesh), time.monotonic() + timeout
    while True:
        status = stub.GetExpertStatus(expert_pb2.ExpertStatusRequest())
        if len(status.placement.members) == members:
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"no placement over {members} expert services")
        if status.placement.members:
            stub.Rebalance(expert_pb2.RebalanceRequest())
        time.sleep(0.2)


async def _collect(engine: AsyncLLM, prompt, params, request_id: str) -> list[int]:
    final = None
    async for out in engine.generate(prompt, params, request_id=request_id):
        final = out
    return list(final.outputs[0].token_ids)


async def _generate(mesh: Mesh, model: str, prompts, params, fallback: str, transport: str,
                    options: dict):  # fmt: skip
    engine = AsyncLLM.from_model(model, device="cpu", **options)
    control = ExpertControl(engine, model, f"test-worker-{time.monotonic_ns()}",
                            mesh.scheduler_address, "127.0.0.1", fallback, timeout=5.0,
                            transport=transport)  # fmt: skip
    task = asyncio.create_task(control.run())
    try:
        deadline = time.monotonic() + 30
        while control.installed is None or not control.installed.members:
            if time.monotonic() > deadline:
                raise TimeoutError("the worker got no placement")
            await asyncio.sleep(0.05)
        outputs = await asyncio.gather(*(_collect(engine, p, params, f"r{i}")
                                         for i, p in enumerate(prompts)))  # fmt: skip
        return outputs, control.experts.record.snapshot() | {"transport": control.group.transport}
    finally:
        task.cancel()
        engine.close()
        # this process lives on (a worker's would exit and close its connections): the
        # members are told the group is done, or their stop would wait on its reads
        await control.close(graceful=True)


def generate_remote(mesh: Mesh, model: str, prompts=PROMPTS, params=GREEDY,
                    fallback: str = "replicas", transport: str = "auto", **options):  # fmt: skip
    """Token ids of each prompt from an engine whose experts run on `mesh`'s
    expert services, and the worker's expert traffic totals (and the transport
    its group took)."""
    return asyncio.run(_generate(mesh, model, prompts, params, fallback, transport, options))
