"""An asyncio streaming wrapper: the engine steps in its own thread and each
request's outputs arrive on an asyncio queue.

    async for out in llm.generate(prompt, params, request_id="r1"):
        ...  # cumulative RequestOutput (or only what is new, delta=True);
             # the last one has finished=True

Services build an EngineRequest and call `stream` (or `add` and
`reserve_remote` for a handoff). Validation happens in the caller, before
anything is queued, once: `validate` returns the request marked. Leaving the
`async for` early (a client that went away) aborts the request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

from basis.sampling_params import SamplingParams
from engine.block_pool import KVEvents
from engine.config import EngineConfig
from engine.disaggregation import Reservation
from engine.engine_thread import EngineThread
from engine.facts import EngineFacts
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.request import EngineRequest


class AsyncLLM:
    """The engine for services: requests in, streams of outputs back, and the few
    facts about the engine that a worker advertises or hands to a KV transport.
    Only the engine thread touches the engine; nothing outside reaches into it."""

    def __init__(self, engine: LLMEngine):
        self._engine = engine
        self.tokenizer = engine.tokenizer
        self._thread = EngineThread(engine)

    @classmethod
    def from_model(cls, model: str | Path, **options) -> AsyncLLM:
        return cls(LLMEngine(model, EngineConfig.from_options(**options)))

    # -- public API ----------------------------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        **fields,
    ) -> EngineRequest:
        """The request for a prompt (text is tokenized here; `fields`: priority,
        namespace, public_tokens); not validated yet."""
        return self._engine.make_request(request_id, prompt, params, **fields)

    def validate(self, request: EngineRequest) -> EngineRequest:
        """The request marked valid (the engine does not check it again), or a
        ValueError; runs in the caller's thread and changes nothing."""
        return self._engine.validate(request)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        *,
        delta: bool = False,
        **fields,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the outputs of a prompt (`stream` of `make_request`)."""
        request = self.make_request(request_id, prompt, params, **fields)
        async for out in self.stream(request, delta=delta):
            yield out

    async def stream(
        self, request: EngineRequest, *, delta: bool = False
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs. A bad request is a ValueError here, before
        anything changes."""
        if self._thread.stopped:
            raise RuntimeError("the engine has shut down")
        request = self.validate(request)  # here: the engine's thread needs not
        stream = self.open_stream(request.request_id)
        self._thread.add(request.request_id, dict(request=request, delta=delta))
        async for out in stream:
            yield out

    def open_stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Where a request's outputs will arrive (open it before `add` or
        `reserve_remote`). Leaving the iteration early aborts the request."""
        return self._iterate(request_id, self._thread.open(request_id))

    async def _iterate(self, request_id: str, queue):
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

    async def add(
        self,
        request: EngineRequest,
        *,
        handoff=None,
        hold_seconds: float | None = None,
    ) -> None:
        """Queues a request whose stream is already open (`open_stream`), between
        steps; its outputs carry only what is new (delta). Prefill role: `handoff`
        sends the prompt's KV out layer by layer, `hold_seconds` keeps its blocks
        after it finishes until `release_held`. A bad request is a ValueError."""
        await self._call(
            lambda e: e.add(request, delta=True, handoff=handoff, hold_seconds=hold_seconds)
        )

    async def reserve_remote(self, request: EngineRequest) -> Reservation | None:
        """Decode role: blocks for the prompt, to be filled from outside (None: not
        free now). Open the request's stream first."""
        return await self._call(lambda e: e.reserve_remote(request, delta=True))

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

    # -- the shared tier's side (the worker moves the bytes) ----------------------
    async def cached_prefix_blocks(
        self, prompt_ids: list[int], namespace: str = "", public_tokens: int = 0
    ) -> int:
        """How many leading full blocks of a prompt the device or host tier holds."""
        return await self._call(
            lambda e: e.tiers.cached_prefix_blocks(prompt_ids, namespace, public_tokens)
        )

    def peek_cached_prefix(self, hashes: list[int]) -> int:
        """How many leading block `hashes` the device or host tier holds, read in the
        caller's thread without waiting for a step: membership tests only, an
        estimate that may be a step old (admission finds the real prefix)."""
        return self._engine.tiers.peek_prefix_blocks(hashes)

    def peek_device_prefix(self, hashes: list[int]) -> int:
        """How many leading `hashes` the device holds (like `peek_cached_prefix`)."""
        return self._engine.tiers.peek_device_prefix(hashes)

    async def import_device_begin(self, hashes: list[int], start: int) -> list[int]:
        """Device block ids held for `hashes[start:]` (the first ones the device lacks,
        as many as it can spare), to fill with `copy_into_blocks`, then
        `import_device_end`; none unless the device holds `hashes[:start]`."""
        return await self._call(lambda e: e.import_device_begin(hashes, start))

    def copy_into_blocks(self, rows: list, block_ids: list[int]):
        """Starts copying rows (host tensors, [layers, *block] each) into held device
        blocks, in the caller's thread; returns a function that waits for them."""
        return self._engine.tiers.copy_into_blocks(rows, block_ids)

    async def import_device_end(self, block_ids: list[int], hashes: list[int], filled: int) -> None:
        """The first `filled` held blocks hold `hashes` now (a prompt's admission finds
        them like any device hit); the rest are let go."""
        await self._call(lambda e: e.import_device_end(block_ids, hashes, filled))

    async def export_begin(self, hashes: list[int]) -> list[tuple[int, int]]:
        """(hash, host slot) of the leading `hashes` in the host tier, pinned until
        `export_end`; read them with `host_slot_bytes` from any thread."""
        return await self._call(lambda e: e.tiers.export_begin(hashes))

    async def export_end(self, slots: list[int]) -> None:
        await self._call(lambda e: e.tiers.export_end(slots))

    async def import_begin(self, hashes: list[int]) -> list[tuple[int, int]]:
        """(hash, host slot) to fill for the leading `hashes` (`host_slot_bytes`),
        then `import_end`; a prompt's admission finds them like any host hit."""
        return await self._call(lambda e: e.tiers.import_begin(hashes))

    async def import_end(self, slots: list[int], filled: int) -> None:
        """The first `filled` of `slots` hold their blocks; the rest are emptied."""
        await self._call(lambda e: e.tiers.import_end(slots, filled))

    @property
    def host_region(self) -> tuple[str, int] | None:
        """(path, size) of the host tier's shared-memory file (slot i at i times the
        block's bytes), for a KV store on this host to read and fill; None if the
        tier is private memory or absent."""
        host = self._engine.tiers.host
        return host.region if host is not None else None

    def host_slot_bytes(self, slot: int):
        """A host-tier slot's pinned memory as a flat uint8 numpy array (no copy);
        valid while the slot is held by export_begin or import_begin."""
        return self._engine.tiers.host.slot_bytes(slot)

    async def kv_snapshot(self) -> tuple[list[int], list[int]]:
        """Every block hash cached on the device and in the host tier; the KV events
        before it are dropped (it includes them), later ones keep coming."""
        return await self._thread.snapshot_kv()

    async def parallel_stats(self) -> list[dict]:
        """Per rank of a parallel engine: busy and collective seconds, steps."""
        return await self._call(lambda e: e.runner.parallel_stats())

    def on_fatal(self, callback) -> None:
        """`callback(reason)` when the engine can never step again (a rank of a parallel
        engine died): a worker exits, so its streams move to another worker."""
        self._engine.runner.on_fatal(callback)

    @property
    def facts(self) -> EngineFacts:
        """Block size, layers, device, KV layout: fixed since start-up."""
        return self._engine.facts

    @property
    def startup(self):
        """How long the engine took to start, by phase (engine/startup.py)."""
        return self._engine.startup

    @property
    def kv_caches(self) -> list:
        """The KV cache, one tensor per layer: what KV transports read and write."""
        return self._engine.kv_caches

    async def set_expert_backend(self, experts) -> None:
        """Where the MoE layers' routed experts run from the next step on
        (engine/expert_backend.py), e.g. on expert services instead of here."""
        await self._call(lambda e: e.runner.set_expert_backend(experts))

    async def _call(self, fn):
        return await self._thread.call(fn)

    def abort(self, request_id: str) -> None:
        self._thread.abort(request_id)

    def get_stats(self) -> dict:
        """The engine's statistics as of its last step."""
        return self._thread.stats

    def drain_kv_events(self) -> KVEvents:
        """Prefix-cache blocks stored and removed since the last call."""
        return self._thread.drain_events()

    def shutdown(self) -> None:
        """Stops the engine thread; every open stream ends with an error."""
        self._thread.stop()

    def close(self) -> None:
        """Shuts down and frees the device memory (weights, KV cache, graphs)."""
        if self._thread.stop():
            self._engine.close()
