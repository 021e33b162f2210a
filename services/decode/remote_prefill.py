"""The decode worker's side of a KV handoff, free of gRPC (the prefill client
is handed in).

The decode worker owns the request: it reserves blocks for the prompt
(skipping the ones its prefix cache holds), asks the prefill worker to fill
them over the transport that suits the pair, waits until every layer landed,
and commits the prefill's first token. If anything in the handoff fails, the
reservation is dropped and the request is prefilled here instead, so a dead
prefill worker costs time, never the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

from engine import AsyncLLM, Logprob
from engine.request import EngineRequest
from services.kv_transport.registry import PerTransport, choose_transport, make_receiver
from services.worker.handoff import HandoffOrder

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class HandoffTiming:
    queue_seconds: float = 0.0
    prefill_seconds: float = 0.0
    transfer_seconds: float = 0.0
    transfer_bytes: int = 0
    transfer_blocks: int = 0
    skipped_blocks: int = 0
    prefill_worker_id: str = ""
    transport: str = ""
    committed_at: float | None = None
    fell_back: str = ""  # why the request was prefilled here after all


class RemotePrefill:
    def __init__(
        self,
        engine: AsyncLLM,
        client,
        endpoint: dict,
        worker_id: str,
        lease_seconds: float = 30.0,
        timeout: float = 120.0,
    ):
        self.engine = engine
        self.client = client
        self.endpoint = endpoint  # this worker: host, device, transports
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.timeout = timeout
        kv_caches, host = engine.kv_caches, endpoint["host"]
        self.receivers = PerTransport(lambda name: make_receiver(name, kv_caches, host))
        self.num_layers = engine.facts.num_layers

    async def run(self, request: EngineRequest, prefill_address: str) -> HandoffTiming:
        """Adds the request (validated) to the engine, with its prompt KV from
        `prefill_address` when the handoff works, else to be prefilled locally.
        Outputs then flow on the request's stream (open it first)."""
        timing = HandoffTiming()
        request_id, params = request.request_id, request.params
        start = time.monotonic()
        reservation = await self.engine.reserve_remote(request)
        timing.queue_seconds = time.monotonic() - start
        if reservation is None:
            timing.fell_back = "no free blocks to reserve"
            await self.engine.add(request)  # prefilled here
            return timing
        timing.skipped_blocks = reservation.skip_blocks
        # Each attempt gets its own id on the wire: a retried or migrated request must
        # never meet the leftovers of an earlier attempt in a transport or engine.
        transfer_id = f"{request_id}/{self.worker_id}/{uuid.uuid4().hex[:8]}"
        receiver = None
        try:
            remote = await self.client.info(prefill_address)
            timing.prefill_worker_id = remote["worker_id"]
            timing.transport = choose_transport(self.endpoint, remote)
            receiver = await self.receivers.started(timing.transport)
            receiver.expect(transfer_id, reservation.dst_block_ids, self.num_layers)
            asked = time.monotonic()
            order = HandoffOrder(
                timing.transport,
                receiver.target(),
                reservation.dst_block_ids,
                reservation.skip_blocks,
                self.lease_seconds,
                self.worker_id,
            )
            result = await self.client.prefill(
                prefill_address,
                request.replace(request_id=transfer_id),
                order,
                timeout=self.timeout,
            )
            receiver.mark_done(transfer_id)
            await receiver.wait(transfer_id, self.timeout)
        except asyncio.CancelledError:
            # the caller left: nothing may land in blocks the engine frees now
            if receiver is not None:
                receiver.cancel(transfer_id)
            raise
        except Exception as exc:
            if receiver is not None:
                receiver.cancel(transfer_id)
            logger.warning(
                "handoff of %s from %s failed (%s); prefilling here",
                request_id,
                prefill_address,
                exc,
            )
            await self.engine.cancel_remote(request_id)
            timing.fell_back = str(exc)
            await self.engine.add(request)
            return timing
        timing.prefill_seconds = result.prefill_seconds
        timing.transfer_seconds = max(0.0, time.monotonic() - asked - result.prefill_seconds)
        timing.transfer_bytes, timing.transfer_blocks = result.transfer_bytes, result.num_blocks
        top = None
        if params.logprobs is not None:
            top = {t: Logprob(lp, r) for t, lp, r in result.top_logprobs}
            top.setdefault(result.first_token_id, Logprob(result.first_logprob, 0))
        # taken before the commit: the engine may decode (even finish) the request before
        # this coroutine resumes, and the decode stage must not start after its end; kept
        # only once the commit succeeded
        committed_at = time.monotonic()
        await self.engine.commit_remote(
            request_id, result.first_token_id, result.first_logprob, top
        )
        timing.committed_at = committed_at
        asyncio.get_running_loop().create_task(
            self.client.release(prefill_address, result.lease_id)
        )
        return timing

    async def close(self) -> None:
        await self.receivers.close()
