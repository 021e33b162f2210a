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
import socket

from fastapi import Request  # at module level: the route's annotation is resolved here

from bench.grpc_floor import against_server, busy_and_idle

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

    async def call() -> float:
        return (await client.send("floor", [1, 2, 3]))["ttft"] * 1e3

    try:
        return await busy_and_idle(call, calls)
    finally:
        client.close()


def measure(calls: int = 300) -> dict:
    """A streamed request's first event from another process in ms: p50 and p99, busy
    and idle."""
    return against_server(_serve, lambda port: _until_listening(port, calls))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    result = measure(parser.parse_args(argv).calls)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
