"""An asyncio streaming wrapper: the engine steps in its own thread and each
request's outputs arrive on an asyncio queue.

    async for out in llm.generate(prompt, params, request_id="r1"):
        ...  # cumulative RequestOutput (or only what is new, delta=True);
             # the last one has finished=True

Validation happens in the caller, before anything is queued. Leaving the
`async for` early (a client that went away) aborts the request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

from basis.sampling_params import SamplingParams
from engine.block_pool import KVEvents
from engine.config import EngineConfig
from engine.disaggregation import Reservation
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput

logger = logging.getLogger(__name__)


class AsyncLLM:
    """The engine for services: requests in, streams of outputs back, and the few
    facts about the engine that a worker advertises or hands to a KV transport.
    Only the engine thread touches the engine; nothing outside reaches into it."""

    def __init__(self, engine: LLMEngine):
        self._engine = engine
        self.tokenizer = engine.tokenizer
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._pending: list[tuple[str, str, dict]] = []  # (kind, request_id, add_request kwargs)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        # Only the engine thread touches the engine; others read these snapshots.
        self._stats = engine.get_stats()
        self._stats_at, self._stale = time.monotonic(), False
        self._events = KVEvents()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, model: str | Path, **options) -> AsyncLLM:
        return cls(LLMEngine(model, EngineConfig.from_options(**options)))

    # -- public API ----------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        namespace: str = "",
        delta: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        if self._stopped:
            raise RuntimeError("the engine has shut down")
        prompt_ids = self._engine.tokenize(prompt)
        self._engine.validate(prompt_ids, params)
        stream = self.open_stream(request_id)
        kwargs = dict(
            prompt=prompt,
            params=params,
            priority=priority,
            namespace=namespace,
            prompt_token_ids=prompt_ids,
            delta=delta,
        )
        with self._lock:
            self._pending.append(("add", request_id, kwargs))
        self._wake.set()
        async for out in stream:
            yield out

    def open_stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Where a request's outputs will arrive (register before the request is
        added through `call`). Leaving the iteration early aborts the request."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._queues:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._queues[request_id] = (asyncio.get_running_loop(), queue)
        return self._iterate(request_id, queue)

    async def _iterate(self, request_id: str, queue: asyncio.Queue):
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        namespace: str = "",
        handoff=None,
        hold_seconds: float | None = None,
    ) -> None:
        """Queues a request whose stream is already open (`open_stream`), between
        steps; its outputs carry only what is new (delta). Prefill role: `handoff`
        sends the prompt's KV out layer by layer, `hold_seconds` keeps its blocks
        after it finishes until `release_held`. A bad request is a ValueError."""
        await self._call(
            lambda e: e.add_request(
                request_id,
                prompt_ids,
                params,
                priority=priority,
                namespace=namespace,
                prompt_token_ids=prompt_ids,
                delta=True,
                handoff=handoff,
                hold_seconds=hold_seconds,
            )
        )

    async def reserve_remote(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        namespace: str = "",
    ) -> Reservation | None:
        """Decode role: blocks for the prompt, to be filled from outside (None: not
        free now). Open the request's stream first."""
        return await self._call(
            lambda e: e.reserve_remote(
                request_id, prompt_ids, params, priority=priority, namespace=namespace, delta=True
            )
        )

    async def commit_remote(
        self, request_id: str, token_id: int, logprob: float = 0.0, top=None
    ) -> None:
        """Decode role: the reserved blocks are filled; the request continues after the
        prefill side's first token (which its stream receives)."""
        await self._call(lambda e: e.commit_remote(request_id, token_id, logprob, top))

    async def cancel_remote(self, request_id: str) -> None:
        """Decode role: drops a reservation; the request's stream stays open."""
        await self._call(lambda e: e.abort_request(request_id))

    async def release_held(self, request_id: str) -> bool:
        """Prefill role: frees the blocks held for `request_id`'s handoff."""
        return await self._call(lambda e: e.release_held(request_id))

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Every check a request must pass; a ValueError changes nothing."""
        self._engine.validate(prompt_ids, params)

    @property
    def block_size(self) -> int:
        return self._engine.block_size

    @property
    def num_layers(self) -> int:
        return self._engine.num_layers

    @property
    def kv_caches(self) -> list:
        """The KV cache, one tensor per layer: what KV transports read and write."""
        return self._engine.kv_caches

    @property
    def device(self):
        return self._engine.device

    @property
    def num_kv_blocks(self) -> int:
        return self._engine.num_kv_blocks

    @property
    def max_num_seqs(self) -> int:
        return self._engine.config.max_num_seqs

    async def _call(self, fn):
        """Runs `fn(engine)` on the engine thread between steps and returns its
        result. A RequestOutput it returns also goes to that request's stream."""
        if self._stopped:
            raise RuntimeError("the engine has shut down")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._pending.append(("call", "", {"fn": fn, "future": future, "loop": loop}))
        self._wake.set()
        return await future

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._queues.pop(request_id, None) is not None:
                self._pending.append(("abort", request_id, {}))
        self._wake.set()

    def get_stats(self) -> dict:
        """The engine's statistics as of its last step."""
        return self._stats

    def drain_kv_events(self) -> KVEvents:
        """Prefix-cache blocks stored and removed since the last call."""
        with self._lock:
            events, self._events = self._events, KVEvents()
        return events

    def shutdown(self) -> None:
        """Stops the engine thread; every open stream ends with an error."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        with self._lock:
            queues, self._queues = self._queues, {}
        for loop, queue in queues.values():
            try:
                loop.call_soon_threadsafe(
                    queue.put_nowait, RuntimeError("the engine has shut down")
                )
            except RuntimeError:  # that caller's loop is gone
                pass

    def close(self) -> None:
        """Shuts down and frees the device memory (weights, KV cache, graphs)."""
        self.shutdown()
        if not self._thread.is_alive():
            self._engine.close()

    # -- engine thread -------------------------------------------------------
    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        for kind, request_id, kwargs in pending:
            if kind == "call":
                self._run_call(**kwargs)
                continue
            try:
                if kind == "abort":
                    self._engine.abort_request(request_id)
                else:
                    self._engine.add_request(request_id, **kwargs)
            except Exception as exc:  # validated already; anything here is reported, not lost
                self._deliver(request_id, exc, final=True)
        self._publish()

    def _run_call(self, fn, future, loop) -> None:
        try:
            result, error = fn(self._engine), None
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
        with self._lock:
            entry = self._queues.get(request_id)
            if entry is not None and final:
                del self._queues[request_id]
        if entry is not None:
            loop, queue = entry
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the caller's loop closed; nobody is listening
                pass

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # the engine is gone: nobody may wait forever
            logger.exception("engine thread died")
            self._stopped = True
            with self._lock:
                queues, self._queues = self._queues, {}
            for loop, queue in queues.values():
                try:
                    loop.call_soon_threadsafe(
                        queue.put_nowait, RuntimeError(f"the engine stopped: {exc}")
                    )
                except RuntimeError:
                    pass

    def _loop(self) -> None:
        while not self._stopped:
            self._apply_pending()
            if self._engine.expire_held():
                self._publish()  # freed blocks show in the next load report
            if not self._engine.has_work():
                if self._stale:
                    self._publish(force=True)  # the snapshot readers see while idle
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self._engine.step()
            except Exception as exc:
                logger.exception("engine step failed outside the model")
                ids = list(self._engine.requests)
                for request_id in ids:
                    self._engine.abort_request(request_id)
                for request_id in ids:
                    self._deliver(request_id, RuntimeError(f"engine step failed: {exc}"), True)
                continue
            for out in outputs:
                self._deliver(out.request_id, out, out.finished)
            self._publish()

    def _publish(self, force: bool = False) -> None:
        """Refreshes the stats snapshot (at most every 50 ms: it walks every block
        table) and hands on KV events (every time: placement wants them early)."""
        now = time.monotonic()
        self._stale = True
        if force or now - self._stats_at >= 0.05:
            self._stats, self._stats_at, self._stale = self._engine.get_stats(), now, False
        events = self._engine.drain_kv_events()
        if events.stored or events.removed:
            with self._lock:
                self._events.stored.extend(events.stored)
                self._events.removed.extend(events.removed)
