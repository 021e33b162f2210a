"""The floor under any hop of the mesh on this machine: a unary gRPC call
(grpc.aio, uvloop, the standard health service, nothing of the mesh's) between
two processes on loopback, timed back to back and with the processes idle
between calls, as they are when one stream is served. A request through the mesh
makes two such hops before its first token (the gateway to the scheduler, the
gateway to the worker) and its first token one back, so what the mesh adds to a
lone request cannot be less than about that.

Usage: python -m bench.grpc_floor [--calls 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

IDLE_S = 0.005  # between calls when idle: about a decode step


def _loop_factory():
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _serve(ports) -> None:
    async def main():
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(main())


async def busy_and_idle(call: Callable[[], Awaitable[float]], calls: int) -> dict:
    """p50 and p99 of the milliseconds `call` returns, `calls` times back to back ("busy")
    and `calls` times with IDLE_S between them ("idle"), after 50 calls to warm up."""
    for _ in range(50):
        await call()
    out = {}
    for name, pause in (("busy", 0.0), ("idle", IDLE_S)):
        times = []
        for _ in range(calls):
            times.append(await call())
            if pause:
                await asyncio.sleep(pause)
        times.sort()
        out[f"{name}_p50_ms"] = statistics.median(times)
        out[f"{name}_p99_ms"] = times[int(0.99 * (len(times) - 1))]
    return out


def against_server(serve: Callable, timed: Callable[[int], Awaitable[dict]]) -> dict:
    """`timed(port)` on this process's loop (uvloop, as the services run) against
    `serve(ports)` in a spawned process, which puts the port it serves on into `ports`;
    the server is killed after."""
    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=serve, args=(ports,), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(timed(port))
    finally:
        server.kill()
        server.join()


async def _time_calls(port: int, calls: int) -> dict:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest()

        async def call() -> float:
            start = time.perf_counter()
            await stub.Check(request)
            return (time.perf_counter() - start) * 1e3

        return await busy_and_idle(call, calls)


def measure(calls: int = 300) -> dict:
    """Unary round trips to another process in ms: p50 and p99, busy and idle."""
    return against_server(_serve, lambda port: _time_calls(port, calls))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    result = measure(parser.parse_args(argv).calls)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
