"""A TCP proxy that delivers every byte `--delay` seconds late (latency, not a
bandwidth cap), for tests of a slow peer: `python tests/slow_proxy.py --listen
PORT --target HOST:PORT --delay 0.1`. Prints READY once it listens."""

from __future__ import annotations

import argparse
import asyncio
import time


async def _pump(reader, writer, delay: float) -> None:
    queue: asyncio.Queue = asyncio.Queue()

    async def send() -> None:
        while True:
            due, data = await queue.get()
            if data is None:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.create_task(send())
    try:
        while data := await reader.read(1 << 16):
            queue.put_nowait((time.monotonic() + delay, data))
    except ConnectionError:
        pass
    queue.put_nowait((0.0, None))
    try:
        await sender
    except ConnectionError:
        pass


async def main(listen: int, target: str, delay: float) -> None:
    host, port = target.rsplit(":", 1)

    async def handle(client_reader, client_writer) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(
            _pump(client_reader, upstream_writer, delay),
            _pump(upstream_reader, client_writer, delay),
        )

    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    print("READY", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--listen", type=int, required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--delay", type=float, default=0.1)
    a = p.parse_args()
    asyncio.run(main(a.listen, a.target, a.delay))
