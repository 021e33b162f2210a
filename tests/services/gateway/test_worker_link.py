"""The gateway's link to a worker (Decode.Link): many requests over one real gRPC
call on loopback, the worker side the decode service's own Link class, the gateway
side its WorkerPool. Each request sees what a Generate call gave it: its chunks in
order, then its end or its failure as the mesh error; a client that leaves aborts
its request on the worker; a dead worker fails every request on its link."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from proto.yinian.v1 import worker_pb2, worker_pb2_grpc
from services.common.errors import DeadlineExceeded, InvalidRequest, WorkerUnavailable
from services.common.grpc_server import InFlight
from services.decode import link as link_module
from services.decode.link import Link
from services.gateway.clients import WorkerPool


class Worker(worker_pb2_grpc.DecodeServicer):
    """Streams `max_tokens` made-up tokens a request, one a step (every `gap`
    seconds, all running requests together, as an engine's decode step);
    prompt token 1: fails with a ValueError after one token; 2: one token, then
    silence; 3: silence from the start; 4: a cancellation from within (a call of
    its own cancelled); 5: its first token at a step, as a new request's first
    token comes with the running ones' next. Records what it aborted and each
    LinkDown it sent."""

    def __init__(self, gap: float = 0.005):
        self.gap = gap
        self.tick: asyncio.Event | None = None
        self.aborted: list[str] = []
        self.sent: list[worker_pb2.LinkDown] = []
        self.calls = InFlight()
        self.links = 0

    async def chunks(self, request, carrier):
        rid, kind = request.request_id, list(request.prompt_token_ids)[:1]
        try:
            if kind == [3]:
                await asyncio.sleep(3600)
            if kind == [4]:
                raise asyncio.CancelledError
            if kind == [5]:
                await self.step()
            for i in range(request.params.max_tokens):
                yield worker_pb2.GenerateChunk(request_id=rid, token_ids=[100 + i])
                if kind == [1]:
                    raise ValueError(f"{rid}: a bad request")
                await asyncio.sleep(3600) if kind == [2] else await self.step()
            yield worker_pb2.GenerateChunk(request_id=rid, finish_reason=1)
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(rid)
            raise

    async def step(self) -> None:
        if self.tick is None:
            self.tick = asyncio.Event()
            asyncio.get_running_loop().call_later(self.gap, self._ticked)
        await self.tick.wait()

    def _ticked(self) -> None:
        tick, self.tick = self.tick, None
        tick.set()

    async def Link(self, request_iterator, context):
        self.links += 1
        self.link = Link(self.chunks, self.calls.holding)
        async for down in self.link.serve(request_iterator):
            self.sent.append(down)
            yield down


@contextlib.asynccontextmanager
async def serving(worker: Worker):
    server = grpc.aio.server()
    worker_pb2_grpc.add_DecodeServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pool = WorkerPool()
    try:
        yield pool, f"127.0.0.1:{port}", server
    finally:
        await pool.close()
        await server.stop(None)


def request(rid: str, tokens: int = 5, kind: int = 7) -> worker_pb2.GenerateRequest:
    params = worker_pb2.GenerateRequest().params
    params.max_tokens = tokens
    return worker_pb2.GenerateRequest(request_id=rid, prompt_token_ids=[kind, 3], params=params)


async def collect(pool, address, req, timeout=30.0, idle=30.0) -> list[int]:
    tokens = []
    async for chunk in pool.generate(address, req, timeout, idle):
        tokens.extend(chunk.token_ids)
    return tokens


def side_by_side(count: int, tokens: int) -> tuple[Worker, list[list[int]]]:
    """`count` requests of `tokens` tokens at once on one worker: it, and their tokens."""

    async def main():
        worker = Worker()
        async with serving(worker) as (pool, address, _):
            got = await asyncio.gather(*(collect(pool, address, request(f"r{i}", tokens))
                                         for i in range(count)))  # fmt: skip
            return worker, got

    return asyncio.run(main())


def test_requests_share_one_call_and_a_step_of_chunks_travels_as_one_message():
    worker, got = side_by_side(32, 20)
    assert got == [list(range(100, 120))] * 32
    assert worker.links == 1
    chunks = sum(len(d.chunks) for d in worker.sent)
    assert chunks == 32 * 21
    # a step's chunks travel together: one message a step would be 21, one a chunk 672;
    # on a busy CPU the 32 requests' first steps straggle in (42 seen under load)
    assert len(worker.sent) < chunks / 8, (len(worker.sent), chunks)
    assert worker.calls.count == 0


def test_a_new_requests_first_token_goes_to_its_reader_before_the_running_ones_next():
    """In one message down, the running request's token comes first (it waited on the
    step first), yet the new request's reader gets its first token before the running
    one's reader gets that token: a first token does not queue behind every stream."""

    async def main():
        worker, seen = Worker(), []

        async def read(pool, address, req):
            async for chunk in pool.generate(address, req, 30.0, 30.0):
                seen.extend((req.request_id, t) for t in chunk.token_ids)

        async with serving(worker) as (pool, address, _):
            running = asyncio.ensure_future(read(pool, address, request("running", 40)))
            while len(seen) < 5:
                await asyncio.sleep(0.001)
            await read(pool, address, request("new", 3, kind=5))
            await running
        return worker, seen

    worker, seen = asyncio.run(main())
    together = [d for d in worker.sent if [c.request_id for c in d.chunks][-1:] == ["new"]
                and len(d.chunks) == 2 and d.chunks[1].token_ids == [100]]  # fmt: skip
    assert together, "the new request's first token never shared a message"
    running_token = ("running", together[0].chunks[0].token_ids[0])
    assert seen.index(("new", 100)) < seen.index(running_token), seen


def test_a_failed_request_gets_its_error_and_the_others_go_on():
    async def main():
        worker = Worker()
        async with serving(worker) as (pool, address, _):
            good = asyncio.ensure_future(collect(pool, address, request("good", 30)))
            with pytest.raises(InvalidRequest, match="bad: a bad request"):
                await collect(pool, address, request("bad", 5, kind=1))
            return await good

    assert asyncio.run(main()) == list(range(100, 130))


def test_a_reader_that_leaves_aborts_its_request_on_the_worker():
    async def main():
        worker = Worker(gap=0.01)
        async with serving(worker) as (pool, address, _):
            async with contextlib.aclosing(
                pool.generate(address, request("leaver", 1000), 30, 30)
            ) as chunks:
                async for _ in chunks:
                    break
            other = await collect(pool, address, request("stayer", 3))
            for _ in range(100):
                if worker.aborted:
                    break
                await asyncio.sleep(0.01)
            return worker, other

    worker, other = asyncio.run(main())
    assert worker.aborted == ["leaver"]
    assert other == [100, 101, 102]
    assert worker.calls.count == 0


def test_a_silent_worker_and_a_slow_request_end_in_deadline_exceeded():
    async def main():
        worker = Worker()
        async with serving(worker) as (pool, address, _):
            with pytest.raises(DeadlineExceeded, match="sent nothing for"):
                await collect(pool, address, request("silent", 5, kind=2), idle=0.3)
            with pytest.raises(DeadlineExceeded, match="sent nothing for"):
                await collect(pool, address, request("mute", 5, kind=3), idle=0.3)
            with pytest.raises(DeadlineExceeded, match="past its timeout"):
                await collect(pool, address, request("slow", 1000), timeout=0.3)
            await asyncio.sleep(0.1)
            return worker

    worker = asyncio.run(main())
    assert sorted(worker.aborted) == ["mute", "silent", "slow"]  # all cancelled there


def test_a_dead_worker_fails_every_request_on_its_link_and_a_new_link_follows():
    async def main():
        worker = Worker(gap=0.01)
        async with serving(worker) as (pool, address, server):
            runs = [asyncio.ensure_future(collect(pool, address, request(f"r{i}", 1000)))
                    for i in range(4)]  # fmt: skip
            await asyncio.sleep(0.2)
            await server.stop(None)
            errors = await asyncio.gather(*runs, return_exceptions=True)
            port = int(address.rsplit(":", 1)[1])
            again = grpc.aio.server()
            worker_pb2_grpc.add_DecodeServicer_to_server(worker, again)
            again.add_insecure_port(f"127.0.0.1:{port}")
            await again.start()
            try:
                for _ in range(50):  # the channel reconnects within its back-off
                    try:
                        return errors, await collect(pool, address, request("after", 2))
                    except WorkerUnavailable:
                        await asyncio.sleep(0.1)
            finally:
                await again.stop(None)

    errors, after = asyncio.run(main())
    assert all(isinstance(e, WorkerUnavailable) for e in errors), errors
    assert after == [100, 101]


def test_a_request_id_already_running_on_the_link_is_refused():
    async def main():
        worker = Worker()
        async with serving(worker) as (pool, address, _):
            first = asyncio.ensure_future(collect(pool, address, request("twice", 50)))
            await asyncio.sleep(0.05)
            with pytest.raises(ValueError, match="already runs"):
                await collect(pool, address, request("twice", 5))
            return await first

    assert asyncio.run(main()) == list(range(100, 150))


def test_running_requests_count_as_open_calls_while_the_worker_drains():
    async def main():
        worker = Worker(gap=0.01)
        async with serving(worker) as (pool, address, _):
            runs = [asyncio.ensure_future(collect(pool, address, request(f"r{i}", 30)))
                    for i in range(3)]  # fmt: skip
            await asyncio.sleep(0.1)
            during = worker.calls.count
            idle = await worker.calls.wait_idle(10)
            await asyncio.gather(*runs)
            return during, idle, worker.calls.count

    assert asyncio.run(main()) == (3, True, 0)


def test_a_worker_that_closes_its_links_ends_their_requests_and_the_call():
    async def main():
        worker = Worker(gap=0.01)
        async with serving(worker) as (pool, address, server):
            runs = [asyncio.ensure_future(collect(pool, address, request(f"r{i}", 1000)))
                    for i in range(2)]  # fmt: skip
            await asyncio.sleep(0.1)
            worker.link.close()
            errors = await asyncio.gather(*runs, return_exceptions=True)
            started = asyncio.get_running_loop().time()
            await server.stop(grace=5.0)  # nothing left open: no grace to wait out
            return worker, errors, asyncio.get_running_loop().time() - started

    worker, errors, stop_s = asyncio.run(main())
    assert all(isinstance(e, WorkerUnavailable) for e in errors), errors
    assert sorted(worker.aborted) == ["r0", "r1"]
    assert stop_s < 1.0, stop_s


def test_a_request_cancelled_within_the_worker_fails_at_once():
    async def main():
        worker = Worker()
        async with serving(worker) as (pool, address, _):
            started = asyncio.get_running_loop().time()
            with pytest.raises(WorkerUnavailable, match="cancelled"):
                await collect(pool, address, request("inner", 5, kind=4), timeout=30, idle=30)
            return asyncio.get_running_loop().time() - started

    assert asyncio.run(main()) < 5  # not the request's timeout or idle wait


def test_a_big_step_is_split_and_each_end_follows_its_chunks(monkeypatch):
    monkeypatch.setattr(link_module, "MAX_CHUNKS", 5)
    worker, got = side_by_side(12, 6)
    assert got == [list(range(100, 106))] * 12
    assert max(len(d.chunks) for d in worker.sent) == 5
    ended: set[str] = set()
    for down in worker.sent:  # no chunk of a request after its end
        assert not {c.request_id for c in down.chunks} & ended
        ended |= {e.request_id for e in down.ends}
    assert len(ended) == 12


def test_readers_cancelled_at_once_leave_the_link_to_the_others():
    async def main():
        worker = Worker()
        async with serving(worker) as (pool, address, _):
            other = asyncio.ensure_future(collect(pool, address, request("other", 40)))
            for i in range(20):  # clients that leave as soon as they came
                task = asyncio.ensure_future(collect(pool, address, request(f"gone{i}", 40)))
                await asyncio.sleep(0 if i % 2 else 0.001)
                task.cancel()
            return worker, await other

    worker, other = asyncio.run(main())
    assert other == list(range(100, 140))
    assert worker.links == 1


def test_a_gateway_that_closes_its_side_at_once_gets_every_chunk_and_the_end():
    """One request, then no more (the gateway half-closes before any chunk is made):
    the link still sends all its chunks and its end before the call ends."""

    class Late(Worker):  # its first chunk comes a step after the request
        async def chunks(self, request, carrier):
            await self.step()
            async for chunk in super().chunks(request, carrier):
                yield chunk

    async def main():
        worker = Late()
        async with serving(worker) as (_, address, _server):
            async with grpc.aio.insecure_channel(address) as channel:
                stub = worker_pb2_grpc.DecodeStub(channel)
                ups = [worker_pb2.LinkUp(request=request(f"r{i}", 4)) for i in range(3)]
                return [down async for down in stub.Link(iter(ups), timeout=30)]

    downs = asyncio.run(main())
    tokens: dict[str, list[int]] = {}
    for down in downs:
        for chunk in down.chunks:
            tokens.setdefault(chunk.request_id, []).extend(chunk.token_ids)
    assert tokens == {f"r{i}": [100, 101, 102, 103] for i in range(3)}
    assert sorted(e.request_id for d in downs for e in d.ends) == ["r0", "r1", "r2"]
    assert all(e.code == 0 for d in downs for e in d.ends)
