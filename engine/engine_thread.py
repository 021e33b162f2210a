"""The engine's own thread: it steps an LLMEngine and is the only thread that
touches it. Other threads (asyncio loops) queue adds, aborts and calls, which
the thread applies between steps; they read each request's outputs from its
asyncio queue and the engine's statistics from a snapshot."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from engine.block_pool import KVEvents
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput

logger = logging.getLogger(__name__)
THREAD_PARTS = ("step", "calls", "requests", "housekeeping", "publish", "idle")


class EngineThread:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._pending: list[tuple[str, str, dict]] = []  # (kind, request_id, kwargs)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.stopped = False
        self._times = dict.fromkeys(THREAD_PARTS, 0.0)
        self._stats = engine.get_stats() | {"engine_thread_seconds": dict(self._times)}
        self._stats_at, self._stale = time.monotonic(), False
        self._events = KVEvents()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- any thread ------------------------------------------------------------
    def open(self, request_id: str) -> asyncio.Queue:
        """The queue a request's outputs (and a final error) arrive on."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._queues:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._queues[request_id] = (asyncio.get_running_loop(), queue)
        return queue

    def add(self, request_id: str, kwargs: dict) -> None:
        with self._lock:
            self._pending.append(("add", request_id, kwargs))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._queues.pop(request_id, None) is not None:
                self._pending.append(("abort", request_id, {}))
        self._wake.set()

    async def call(self, fn):
        """Runs `fn(engine)` between steps and returns its result. A RequestOutput
        it returns also goes to that request's queue."""
        if self.stopped:
            raise RuntimeError("the engine has shut down")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._pending.append(("call", "", {"fn": fn, "future": future, "loop": loop}))
        self._wake.set()
        return await future

    @property
    def stats(self) -> dict:
        return self._stats

    async def snapshot_kv(self) -> tuple[list[int], list[int]]:
        """(device hashes, host hashes) cached now; the KV events before this point are
        dropped (the snapshot includes them), those after it are kept."""

        def take(engine):
            with self._lock:
                self._events = KVEvents()
            return engine.tiers.snapshot()

        return await self.call(take)

    def drain_events(self) -> KVEvents:
        with self._lock:
            events, self._events = self._events, KVEvents()
        return events

    def stop(self) -> bool:
        """Stops the thread; every open queue gets an error. True once it has ended."""
        self.stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        self._fail_all(RuntimeError("the engine has shut down"))
        return not self._thread.is_alive()

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            queues, self._queues = self._queues, {}
        for loop, queue in queues.values():
            try:
                loop.call_soon_threadsafe(queue.put_nowait, error)
            except RuntimeError:  # that caller's loop is gone
                pass

    # -- engine thread -------------------------------------------------------
    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        for kind, request_id, kwargs in pending:
            start = time.perf_counter()
            if kind == "call":
                self._run_call(**kwargs)
                self._times["calls"] += time.perf_counter() - start
                continue
            try:
                if kind == "abort":
                    self.engine.abort_request(request_id)
                else:
                    self.engine.add(**kwargs)
            except Exception as exc:  # validated already; anything here is reported, not lost
                self._deliver(request_id, exc, final=True)
            self._times["requests"] += time.perf_counter() - start
        self._publish()

    def _run_call(self, fn, future, loop) -> None:
        try:
            result, error = fn(self.engine), None
        except Exception as exc:
            result, error = None, exc
        if isinstance(result, RequestOutput):
            self._deliver(result.request_id, result, result.finished)

        def settle():
            if future.cancelled():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the caller's loop is gone
            pass

    def _deliver(self, request_id: str, item, final: bool) -> None:
        self._deliver_all([(request_id, item, final)])

    def _deliver_all(self, items: list[tuple[str, object, bool]]) -> None:
        """Hands each (request_id, item, final) to its request's queue: one wake-up a
        loop for all of them (a step's outputs arrive together, not one call each)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for request_id, item, final in items:
                entry = self._queues.get(request_id)
                if entry is None:
                    continue
                if final:
                    del self._queues[request_id]
                loop, queue = entry
                by_loop.setdefault(loop, []).append((queue, item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:  # the caller's loop closed; nobody is listening
                pass

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # the engine is gone: nobody may wait forever
            logger.exception("engine thread died")
            self.stopped = True
            self._fail_all(RuntimeError(f"the engine stopped: {exc}"))

    def _loop(self) -> None:
        times = self._times
        while not self.stopped:
            self._apply_pending()
            start = time.perf_counter()
            freed = self.engine.housekeeping()
            times["housekeeping"] += time.perf_counter() - start
            if freed:
                self._publish()  # freed blocks show in the next load report
            if not self.engine.has_work():
                if self._stale or time.monotonic() - self._stats_at >= 1.0:
                    self._publish(force=True)  # the snapshot readers see while idle
                start = time.perf_counter()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                times["idle"] += time.perf_counter() - start
                continue
            start = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as exc:
                logger.exception("engine step failed outside the model")
                ids = list(self.engine.requests)
                for request_id in ids:
                    self.engine.abort_request(request_id)
                error = RuntimeError(f"engine step failed: {exc}")
                self._deliver_all([(request_id, error, True) for request_id in ids])
                continue
            finally:
                times["step"] += time.perf_counter() - start
            self._deliver_all([(out.request_id, out, out.finished) for out in outputs])
            self._publish()

    def _publish(self, force: bool = False) -> None:
        """Refreshes the stats snapshot (at most every 50 ms: it walks every block
        table) and hands on KV events (every time: placement wants them early)."""
        start = time.perf_counter()
        now = time.monotonic()
        self._stale = True
        if force or now - self._stats_at >= 0.05:
            stats = self.engine.get_stats() | {"engine_thread_seconds": dict(self._times)}
            self._stats, self._stats_at, self._stale = stats, now, False
        events = self.engine.drain_kv_events()
        if events:
            with self._lock:
                self._events.extend(events)
        self._times["publish"] += time.perf_counter() - start


def _put_all(puts: list) -> None:
    for queue, item in puts:
        queue.put_nowait(item)
