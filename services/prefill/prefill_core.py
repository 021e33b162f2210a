"""The prefill service's core, free of gRPC: one handoff from request to done —
compute the prompt, send its blocks layer by layer as each layer is computed,
sample the first token, and hold the blocks under a lease."""

from __future__ import annotations

import time
from collections.abc import Callable

from engine import AsyncLLM
from engine.disaggregation import Handoff
from engine.request import EngineRequest
from services.kv_transport.base import KvSender, LayerPlan, TransferError
from services.worker.handoff import HandoffOrder, PrefillResult
from services.worker.logprobs import position
from services.worker.shared_kv import SharedKv


class TransportHandoff(Handoff):
    """Feeds the engine's per-layer hook into a transport sender."""

    def __init__(
        self,
        sender: KvSender,
        target: bytes,
        request_id: str,
        dst_block_ids: list[int],
        skip_blocks: int,
        num_layers: int,
    ):
        super().__init__(skip_blocks)
        self.sender, self.target = sender, target
        self.request_id, self.dst = request_id, dst_block_ids
        self.num_layers = num_layers
        self.plan: LayerPlan | None = None
        self.error: str | None = None

    def start(self, src_block_ids: list[int]) -> None:
        if len(src_block_ids) != len(self.dst):
            self.error = (
                f"prefill holds {len(src_block_ids)} prompt blocks past the skipped "
                f"ones; the decode side reserved {len(self.dst)}"
            )
            return
        self.plan = LayerPlan(self.request_id, list(src_block_ids), self.dst, self.num_layers)
        try:
            self.sender.begin(self.plan, self.target)
        except Exception as exc:  # reported when the handoff is flushed
            self.error = f"transport {self.sender.name}: {exc!r}"
            self.plan = None

    def send_layer(self, layer: int, cache_layer) -> None:
        if self.plan is not None and self.error is None:
            try:
                self.sender.send_layer(self.request_id, layer, cache_layer)
            except Exception as exc:
                self.error = f"transport {self.sender.name}: {exc!r}"


class PrefillCore:
    def __init__(
        self,
        engine: AsyncLLM,
        sender_for: Callable[[str], KvSender],
        shared: SharedKv | None = None,
    ):
        self.engine = engine
        self.sender_for = sender_for  # transport name -> its sender
        self.shared = shared  # the shared KV tier, when the mesh has a KV store
        self.num_layers = engine.facts.num_layers

    async def prefill(
        self, request: EngineRequest, order: HandoffOrder, timeout: float = 120.0
    ) -> PrefillResult:
        """Computes the prompt, sends blocks order.skip_blocks.. to the order's
        blocks, and returns the first token once every block has landed."""
        request_id, params = request.request_id, request.params
        sender = self.sender_for(order.transport)
        # it runs here up to its first token (checked once, before anything changes)
        first = request.replace(params=params.clone(max_tokens=1, min_tokens=0, stop=[]))
        first = self.engine.validate(first)
        if self.shared is not None:
            await self.shared.prefetch(first.prompt_ids, first.namespace, first.public_tokens)
        handoff = TransportHandoff(
            sender, order.target, request_id, order.dst_block_ids, order.skip_blocks,
            self.num_layers,
        )  # fmt: skip
        stream = self.engine.open_stream(request_id)
        start = time.monotonic()
        final = None
        try:
            await self.engine.add(first, handoff=handoff, hold_seconds=order.lease_seconds)
            async for out in stream:
                final = out
        except BaseException:  # the decode side went away: nothing may stay behind
            self.engine.abort(request_id)
            sender.abort(request_id)
            raise
        prefill_seconds = time.monotonic() - start
        if final is None or final.error or not final.outputs[0].token_ids:
            sender.abort(request_id)
            await self.release(request_id)
            raise TransferError(f"prefill failed: {final.error if final else 'no output'}")
        if handoff.error is not None or handoff.plan is None:
            sender.abort(request_id)
            await self.release(request_id)
            raise TransferError(handoff.error or "the prompt's KV was never sent")
        try:
            stats = await sender.flush(request_id, timeout)
        except Exception:
            await self.release(request_id)
            raise
        completion = final.outputs[0]
        token = completion.token_ids[0]
        if self.shared is not None:
            self.shared.write_through(
                request.prompt_ids,
                [],
                request.namespace,
                request.public_tokens,
                cached_tokens=final.num_cached_tokens,
            )
        logprob, top = 0.0, []
        if completion.logprobs:
            _, logprob, _, top = position(completion.logprobs[0], token, params.logprobs or 0)
        return PrefillResult(
            token,
            logprob,
            top,
            final.num_cached_tokens,
            prefill_seconds,
            stats.seconds,
            stats.bytes,
            len(handoff.plan.src_block_ids),
            lease_id=request_id,
        )

    async def release(self, lease_id: str) -> bool:
        return await self.engine.release_held(lease_id)
