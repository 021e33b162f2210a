"""The floor under the mesh's HTTP hop on this machine: a streamed POST answered by
a bare FastAPI app on uvicorn (httptools, uvloop: the gateway's server stack, none
of the gateway's work) in another process, the time from sending the request to
its first server-sent event, back to back and with the processes idle between
calls. The engine alone is timed in the client's process: through the mesh a
request adds this hop to the client and one gRPC hop to the worker
(bench/grpc_floor.py) at the least.

Usage: python -m bench.http_floor [--calls 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import statistics

from fastapi import Request  # at module level: the route's annotation is resolved here

from bench.grpc_floor import IDLE_S, _loop_factory

CHUNK = b'data: {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}], ' \
        b'"usage": {"completion_tokens": 1}}\n\n'  # fmt: skip


def _serve(ports) -> None:
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        json.loads(await request.body())  # a request's body read and parsed, as any

        async def events():
            yield CHUNK
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    ports.put(sock.getsockname()[1])
    config = uvicorn.Config(app, http="httptools", loop="uvloop", log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


async def _until_listening(port: int, calls: int) -> dict:
    for _ in range(200):  # the port is bound before uvicorn listens on it
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            break
        except OSError:
            await asyncio.sleep(0.05)
    return await _time_calls(port, calls)


async def _time_calls(port: int, calls: int) -> dict:
    from bench.mesh_overhead import MeshClient  # the mesh's own client (h11, keep-alive)

    client = MeshClient("127.0.0.1", port, "floor", output_len=1)
    try:
        for _ in range(50):
            await client.send("warm", [1, 2, 3])
        out = {}
        for name, pause in (("busy", 0.0), ("idle", IDLE_S)):
            times = []
            for _ in range(calls):
                times.append((await client.send("floor", [1, 2, 3]))["ttft"] * 1e3)
                if pause:
                    await asyncio.sleep(pause)
            times.sort()
            out[f"{name}_p50_ms"] = statistics.median(times)
            out[f"{name}_p99_ms"] = times[int(0.99 * (len(times) - 1))]
        return out
    finally:
        client.close()


def measure(calls: int = 300) -> dict:
    """A streamed request's first event from another process in ms: p50 and p99, busy
    and idle."""
    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=_serve, args=(ports,), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:  # as the services run
            return runner.run(_until_listening(port, calls))
    finally:
        server.kill()
        server.join()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    result = measure(parser.parse_args(argv).calls)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
