"""A test-only decode worker that breaks its streams on purpose, to provoke each way
a stream can end early. It registers with the real scheduler, heartbeats over real
NATS and serves the real `Decode` service (alone or over a gateway's link), but has
no engine: it streams made-up token ids and then does what its control file says
(re-read on every request):

    finish        every output to max_tokens, with its finish reason (a good worker)
    close K       K tokens, then the stream closes with status OK and no finish reason
    die K         K tokens, then the process kills itself (SIGKILL)

`python tests/faulty_worker.py --scheduler H:P --nats-url URL --control FILE`
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from proto.yinian.v1 import (  # noqa: E402
    common_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.bus import EventBus, load_subject  # noqa: E402
from services.common.processes import free_port  # noqa: E402
from services.common.tls import aio_channel  # noqa: E402
from services.decode.link import Link  # noqa: E402

FIRST_TOKEN = 20  # made-up token ids count up from here


class FaultyDecode(worker_pb2_grpc.DecodeServicer):
    def __init__(self, control: Path):
        self.control = control
        self.requests = 0

    async def Generate(self, request, context):
        self.requests += 1
        words = (self.control.read_text().split() or ["finish"]) + ["0"]
        mode, count = words[0], int(words[1])
        n, max_tokens = max(1, request.params.n), request.params.max_tokens or 16
        start = len(request.resume_token_ids)
        steps = max_tokens - start if mode == "finish" else min(count, max_tokens - start)
        for step in range(steps):
            last = mode == "finish" and step == steps - 1
            for index in range(n):
                yield worker_pb2.GenerateChunk(
                    request_id=request.request_id,
                    index=index,
                    token_ids=[FIRST_TOKEN + start + step],
                    prompt_tokens=len(request.prompt_token_ids),
                    finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0,
                )
            await asyncio.sleep(0.01)
        if mode == "die":
            await asyncio.sleep(0.2)  # the chunks reach the gateway first
            os.kill(os.getpid(), signal.SIGKILL)
        # "close": returning ends the call with OK, outputs unfinished

    async def Link(self, request_iterator, context):
        """The same requests over a gateway's link (services/decode/link.py)."""
        link = Link(lambda request, _: self.Generate(request, context), contextlib.nullcontext)
        async for down in link.serve(request_iterator):
            yield down


async def heartbeat(bus: EventBus, worker_id: str) -> None:
    while True:
        report = common_pb2.LoadReport(worker_id=worker_id, kv_blocks_total=1000)
        await bus.publish(load_subject(worker_id), report)
        await asyncio.sleep(0.3)


async def main(args) -> None:
    port = free_port()
    server = grpc.aio.server()
    worker_pb2_grpc.add_DecodeServicer_to_server(FaultyDecode(Path(args.control)), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    bus = EventBus(args.nats_url, args.worker_id)
    await bus.connect()
    info = scheduler_pb2.WorkerInfo(
        worker_id=args.worker_id,
        address=f"127.0.0.1:{port}",
        role="colocated",
        model="faulty",
        block_size=16,
        max_num_seqs=64,
        kv_blocks_total=1000,
        host="127.0.0.1",
        device="cpu",
    )
    async with aio_channel(args.scheduler, None) as channel:
        await scheduler_pb2_grpc.SchedulerStub(channel).Register(info, timeout=10)
    beats = asyncio.create_task(heartbeat(bus, args.worker_id))
    print(f"READY faulty worker {args.worker_id} 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()
    beats.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--scheduler", required=True)
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--control", required=True)
    parser.add_argument("--worker-id", default="faulty-0")
    asyncio.run(main(parser.parse_args()))
