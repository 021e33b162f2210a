"""Graceful drain: SIGTERM takes a worker out of placement at once, lets its
streams finish (or, past `--drain-timeout`, ends them so that the gateway moves
them), then exits; a rolling restart of every worker under load fails nothing."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx

from bench.loadgen.client import RequestInput, send_request
from yinian.mesh import Mesh, MeshSpec
from yinian.mesh_probe import gateway_metric, list_workers
from yinian.supervisor import Supervisor


class SteadyLoad:
    """`streams` streamed completions at all times until stopped, in a thread."""

    def __init__(self, url: str, streams: int, max_tokens: int):
        self.url, self.streams, self.max_tokens = url, streams, max_tokens
        self.results = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        async def one_stream(k: int) -> None:
            async with httpx.AsyncClient(timeout=120) as client:
                i = 0
                while not self._stop.is_set():
                    request = RequestInput(f"{self.url}/v1/completions", "tiny-llama",
                                           f"load {k} {i}", 0, self.max_tokens)  # fmt: skip
                    self.results.append(await send_request(client, request))
                    i += 1

        await asyncio.gather(*(one_stream(k) for k in range(self.streams)))

    def __enter__(self) -> SteadyLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


def supervised(mesh: Mesh) -> tuple[Supervisor, threading.Event]:
    stop = threading.Event()
    supervisor = Supervisor(mesh, say=print)
    threading.Thread(target=supervisor.run, args=(stop,), daemon=True).start()
    return supervisor, stop


def wait_back(mesh: Mesh, supervisor: Supervisor, name: str, workers: int) -> None:
    deadline = time.monotonic() + 90
    while supervisor.restarts(name) < 1 or supervisor.back_at(name) is None:
        assert time.monotonic() < deadline, f"{name} not restarted"
        time.sleep(0.1)
    while sum(w.ready for w in list_workers(mesh)) < workers:
        assert time.monotonic() < deadline, f"{name} not registered again"
        time.sleep(0.1)


def running(mesh: Mesh, worker_id: str) -> int:
    return sum(w.num_requests_running for w in list_workers(mesh) if w.info.worker_id == worker_id)


def wait_first_tokens(mesh: Mesh, count: int, deadline: float) -> None:
    """Until `count` streams have had their first token at the gateway."""
    while gateway_metric(mesh, "yinian:time_to_first_token_seconds_count") < count:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_rolling_restart_under_load_fails_no_request(model_dir):
    spec = MeshSpec(model=str(model_dir("tiny-llama")), workers=0, prefill=1, decode=2,
                    port=0, engine_argv=["--device", "cpu"],
                    scheduler_argv=["--disagg-min-tokens", "1"])  # fmt: skip
    with Mesh(spec) as mesh:
        supervisor, stop = supervised(mesh)
        try:
            with SteadyLoad(mesh.url, streams=4, max_tokens=150) as load:
                time.sleep(1.0)
                # Each pool rolls one worker at a time (as two Deployments would):
                # the prefill pool and the decode pool side by side.
                for names in (("prefill-0", "decode-0"), ("decode-1",)):
                    old = [mesh.child(name).proc for name in names]
                    for proc in old:
                        os.killpg(proc.pid, signal.SIGTERM)  # as an orchestrator stops a pod
                    for name in names:
                        wait_back(mesh, supervisor, name, workers=3)
                    assert [proc.returncode for proc in old] == [0] * len(old)  # drained
                time.sleep(1.0)
        finally:
            stop.set()
        failed = [r.error for r in load.results if not r.success]
        assert failed == []
        assert len(load.results) >= 12
        assert all(r.output_tokens == 150 for r in load.results)
        # Every stream finished on the worker it started on: none had to move.
        assert gateway_metric(mesh, "yinian:request_migrations_total") == 0


def test_streams_outlasting_the_drain_timeout_move_to_another_worker(model_dir):
    spec = MeshSpec(model=str(model_dir("tiny-llama")), workers=2, port=0,
                    engine_argv=["--device", "cpu"], drain_timeout=1.0)  # fmt: skip
    with Mesh(spec) as mesh:

        async def streams():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(
                    send_request(client, RequestInput(f"{mesh.url}/v1/completions",
                                                      "tiny-llama", f"long {i}", 0, 1500))
                    for i in range(6)))  # fmt: skip

        results: list = []
        runner = threading.Thread(target=lambda: results.extend(asyncio.run(streams())))
        runner.start()
        deadline = time.monotonic() + 60
        while running(mesh, "worker-0") == 0:  # some streams are on the worker to stop
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # and every stream has answered (a stream moved before any output is a retry)
        wait_first_tokens(mesh, 6, deadline)
        worker = mesh.child("worker-0").proc
        stopped = time.monotonic()
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=30)
        took = time.monotonic() - stopped
        runner.join(timeout=150)
        assert took < 8, f"the worker took {took:.1f} s to stop with a 1 s drain timeout"
        assert runner.is_alive() is False
        assert [r.error for r in results if not r.success] == []
        assert all(r.output_tokens == 1500 for r in results)
        assert gateway_metric(mesh, "yinian:request_migrations_total") >= 1


def test_a_stopped_gateway_finishes_its_streams_and_takes_no_new_connection(model_dir):
    # a mock engine step of 40 ms: a 100-token stream takes about 4 s, past the 2 s a
    # gateway gave its streams on SIGTERM before --drain-timeout
    spec = MeshSpec(model=str(model_dir("tiny-llama")), workers=1, port=0,
                    engine_argv=["--model-runner", "mock", "--mock-step-ms", "40"],
                    gateway_argv=["--drain-timeout", "20"])  # fmt: skip
    with Mesh(spec) as mesh:
        url = mesh.url

        async def stream():
            async with httpx.AsyncClient(timeout=60) as client:
                request = RequestInput(f"{url}/v1/completions", "tiny-llama", "drain", 0, 100)
                return await send_request(client, request)

        results: list = []
        runner = threading.Thread(target=lambda: results.append(asyncio.run(stream())))
        runner.start()
        deadline = time.monotonic() + 60
        wait_first_tokens(mesh, 1, deadline)
        gateway = mesh.child("gateway").proc
        stopped = time.monotonic()
        os.killpg(gateway.pid, signal.SIGTERM)
        time.sleep(0.5)
        try:  # draining: no new connection is taken
            httpx.get(f"{url}/health/live", timeout=2)
            raise AssertionError("the draining gateway took a new connection")
        except httpx.TransportError:
            pass
        runner.join(timeout=60)
        assert results and results[0].success, results and results[0].error
        assert results[0].output_tokens == 100 and results[0].finished
        assert gateway.wait(timeout=30) is not None
        assert time.monotonic() - stopped > 2.5  # it outlasted the old 2 s cut
