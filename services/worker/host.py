"""An engine worker's process, shared by the prefill and decode services: the
engine, a gRPC server (health, reflection, the `Worker` service and the
stage's own), Prometheus metrics, registration with the scheduler, load
reports and numbered KV events on NATS, and a graceful drain on SIGTERM/SIGINT
(out of placement at once, open streams finished for up to `--drain-timeout`,
then stopped; a second signal stops at once).

    host = WorkerHost(config, "yinian-decode")
    host.serve(add_DecodeServicer_to_server, DecodeServicer(...), "yinian.v1.Decode")
    await host.run()
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import sys
from pathlib import Path

from engine import AsyncLLM
from proto.yinian.v1 import common_pb2, scheduler_pb2, worker_pb2_grpc
from services.common import metrics
from services.common.bus import (
    KV_RESYNC_SUBJECT,
    SHARED_KV_SUBJECT,
    EventBus,
    kv_subject,
    load_subject,
)
from services.common.grpc_server import GrpcServer
from services.common.kv_index import SHARED, SHARED_HOLDER, KvIndex
from services.common.telemetry import setup_tracing, shutdown_tracing
from services.worker.kvstore_client import KvStoreClient, fingerprint
from services.worker.rank_metrics import report_ranks
from services.worker.registration import Registration
from services.worker.reports import WorkerReports
from services.worker.servicer import WorkerServicer, load_report
from services.worker.settings import WorkerSettings
from services.worker.shared_kv import SharedKv

logger = logging.getLogger(__name__)
_SHARED_RESYNC = common_pb2.KvResync(worker_id=SHARED_HOLDER, reason="worker follows the tier")


def model_fingerprint(model: str, engine: AsyncLLM):
    """What a stored block must have been made by: this model (its folder's name and
    config), dtype and block layout."""
    path = Path(model)
    config = path / "config.json"
    digest = hashlib.sha256(config.read_bytes()).hexdigest()[:12] if config.is_file() else ""
    facts = engine.facts
    return fingerprint(
        f"{path.name}-{digest}",
        str(facts.kv_dtype).removeprefix("torch."),
        facts.block_size,
        "x".join(map(str, facts.kv_block_shape)),
        facts.num_layers,
    )


def _exit_now(reason: str) -> None:
    """The engine is dead for good (a rank of it died): leave now, without a goodbye,
    so the gateway moves this worker's streams and the scheduler stops placing here."""
    logger.critical("worker exiting: %s", reason)
    logging.shutdown()
    os._exit(70)


class WorkerHost:
    def __init__(self, config: WorkerSettings, service_name: str):
        self.config = config
        self.draining = False  # SIGTERM came: out of placement, finishing its streams
        sys.setswitchinterval(config.switch_interval)
        setup_tracing(service_name)
        options = dict(config.engine_options)
        if config.kvstore and config.kv_write_through in ("prefix", "all"):
            # these policies write blocks nobody reused: the host tier must hold them all
            options.setdefault("host_kv_backup", "all")
        options["detokenize"] = False  # the gateway detokenizes; stop strings still end here
        self.engine = AsyncLLM.from_model(config.model, **options)
        startup = self.engine.startup
        for phase, seconds in startup.seconds.items():
            metrics.STARTUP_SECONDS.labels(worker=config.worker_id, phase=phase).set(seconds)
        logger.info("worker %s: its engine started in %s", config.worker_id, startup)
        self.server = GrpcServer(config.host, config.port, config.tls_files())
        self.address = f"{config.address_host}:{self.server.port}"
        metrics_port = metrics.serve_metrics(config.metrics_port, config.host, metrics.WORKER)
        facts = self.engine.facts
        self.info = scheduler_pb2.WorkerInfo(
            worker_id=config.worker_id,
            address=self.address,
            role=config.role,
            model=config.model,
            block_size=facts.block_size,
            max_num_seqs=facts.max_num_seqs,
            kv_blocks_total=facts.num_kv_blocks,
            metrics_address=f"{config.address_host}:{metrics_port}",
            transports=config.transports(facts.device.type),
            host=config.address_host,
            device=str(facts.device),
            kv_layout=facts.kv_block_layout,
            tensor_parallel_size=facts.tensor_parallel_size,
            pipeline_parallel_size=facts.pipeline_parallel_size,
        )
        self.engine.on_fatal(_exit_now)
        self.reports = WorkerReports(self.engine, config.worker_id)
        self.shared: SharedKv | None = None
        self._closers: list = []
        if config.kvstore:
            client = KvStoreClient(
                config.kvstore, model_fingerprint(config.model, self.engine),
                tls=config.tls_files(),
            )  # fmt: skip
            self.shared = SharedKv(
                self.engine, client, config.worker_id, config.kv_write_through,
                max_pending_bytes=config.kv_write_queue_bytes, index=KvIndex(),
                verify_lent=config.kv_verify_lent_blocks, lend=config.kv_lend,
            )  # fmt: skip
            self.on_close(client.close)
            self.on_close(self.shared.drain)
        self.serve(
            worker_pb2_grpc.add_WorkerServicer_to_server,
            WorkerServicer(self.info, self.reports),
            "yinian.v1.Worker",
        )
        self.experts = None
        if config.expert_parallel:  # MoE experts on expert services
            from services.expert_parallel.control import ExpertControl

            self.experts = ExpertControl(
                self.engine, config.model, config.worker_id, config.scheduler,
                config.address_host, config.expert_fallback, config.expert_timeout,
                tls=config.tls_files(), transport=config.expert_transport,
            )  # fmt: skip
            self.on_close(self.experts.close)

    @property
    def endpoint(self) -> dict:
        """This worker as a KV transport endpoint (see kv_transport/registry.py)."""
        return {
            "host": self.info.host,
            "device": self.info.device,
            "transports": list(self.info.transports),
            "worker_id": self.info.worker_id,
        }

    def serve(self, add_fn, servicer, service_name: str) -> None:
        self.server.add(add_fn, servicer, [service_name])

    def on_close(self, close) -> None:
        """`await close()` runs at shutdown, before the engine stops (last added first)."""
        self._closers.append(close)

    async def run(self) -> None:
        """Serves until SIGTERM or SIGINT, then drains and stops."""
        config = self.config
        await self.server.start()
        bus = EventBus(config.nats_url, config.worker_id)
        await bus.connect()
        registration = Registration(config.scheduler, self.info, config.tls_files())
        await registration.register()
        await registration.listen(bus)
        loops = [
            asyncio.create_task(self._report_load(bus)),
            asyncio.create_task(self._report_kv_events(bus)),
            asyncio.create_task(report_ranks(self.engine, config.worker_id)),
        ]
        if self.experts is not None:
            loops.append(asyncio.create_task(self.experts.run()))
        if self.shared is not None:
            # the store maps our host tier, and we its memory, in the background
            loops.append(asyncio.create_task(self.shared.introduce()))
            await self._follow_shared_tier(bus)
        await self.server.serving(True)
        logger.info("worker %s (%s) serving on %s", config.worker_id, config.role, self.address)
        print(f"READY worker {config.worker_id} {self.address} metrics "
              f"{self.info.metrics_address}", flush=True)  # fmt: skip
        signals = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, signals.put_nowait, sig)
        await signals.get()
        await self.server.serving(False)
        self.draining = True  # said in its load reports from now on, this one first
        await bus.publish(load_subject(config.worker_id), self._load_report())
        await registration.withdraw()
        await self._drain(signals)
        await registration.close()
        for task in loops:
            task.cancel()
        for close in reversed(self._closers):
            await close()
        await self.server.stop(grace=1.0)
        await bus.close()
        self.engine.close()
        shutdown_tracing()

    async def _drain(self, signals: asyncio.Queue) -> None:
        """Lets open streams finish (nothing new is placed here now) for up to
        `drain_timeout` seconds, or until a second signal."""
        open_calls = self.server.in_flight
        logger.info("worker %s draining: %d call(s) open, up to %.0f s",
                    self.config.worker_id, open_calls.count, self.config.drain_timeout)  # fmt: skip
        idle = asyncio.create_task(open_calls.wait_idle(self.config.drain_timeout))
        again = asyncio.create_task(signals.get())
        await asyncio.wait({idle, again}, return_when=asyncio.FIRST_COMPLETED)
        idle.cancel()
        again.cancel()
        if open_calls.count:
            logger.warning("worker %s stopping with %d call(s) open; their streams move to "
                           "other workers", self.config.worker_id, open_calls.count)  # fmt: skip
        else:
            logger.info("worker %s drained", self.config.worker_id)

    async def _follow_shared_tier(self, bus: EventBus) -> None:
        """Keeps the shared tier's index from the KV store's numbered events (asking it
        for a snapshot now, and after any gap), so prefetch asks the store only for
        prompts it may have."""
        index = self.shared.index

        async def on_shared(events: common_pb2.SharedKvEvents, headers) -> None:
            changes = {SHARED: (events.stored, events.removed)}
            if not index.apply(SHARED_HOLDER, events.event_id, changes, events.reset):
                await bus.publish(KV_RESYNC_SUBJECT, _SHARED_RESYNC)

        await bus.subscribe(SHARED_KV_SUBJECT, common_pb2.SharedKvEvents, on_shared)
        await bus.publish(KV_RESYNC_SUBJECT, _SHARED_RESYNC)

    async def _report_load(self, bus: EventBus) -> None:
        labels = {"worker": self.config.worker_id}
        while True:
            load = self.reports.load()
            metrics.NUM_REQUESTS_RUNNING.labels(**labels).set(load["num_requests_running"])
            metrics.NUM_REQUESTS_WAITING.labels(**labels).set(load["num_requests_waiting"])
            metrics.KV_CACHE_USAGE.labels(**labels).set(load["kv_cache_usage"])
            metrics.PREFIX_CACHE_HIT.labels(**labels).set(load["prefix_cache_hit_rate"])
            metrics.NUM_PREEMPTIONS.labels(**labels).set(load["num_preemptions"])
            cache = self.reports.cache_stats()
            metrics.PREFIX_QUERIED_TOKENS.labels(**labels).set(cache["queried_tokens"])
            for tier, tokens in cache["hit_tokens"].items():
                metrics.PREFIX_HIT_TOKENS.labels(tier=tier, **labels).set(tokens)
            metrics.KV_FRAGMENTATION.labels(**labels).set(cache["fragmentation"])
            metrics.HOST_KV_BYTES.labels(direction="to_host", **labels).set(cache["bytes_to_host"])
            metrics.HOST_KV_BYTES.labels(direction="to_device", **labels).set(
                cache["bytes_to_device"]
            )
            for kind, count in cache["host_blocks"].items():
                metrics.HOST_KV_BLOCKS.labels(kind=kind, **labels).set(count)
            self._report_steps(labels)
            await bus.publish(load_subject(self.config.worker_id), self._load_report(load))
            await asyncio.sleep(self.config.load_interval)

    def _load_report(self, load: dict | None = None) -> common_pb2.LoadReport:
        report = load_report(self.reports.load() if load is None else load)
        report.draining = self.draining
        return report

    def _report_steps(self, labels: dict) -> None:
        steps = self.reports.step_stats()
        metrics.ENGINE_STEPS.labels(kind="all", **labels).set(steps["steps"])
        metrics.ENGINE_STEPS.labels(kind="device_timed", **labels).set(steps["device_timed"])
        metrics.ENGINE_STEP_SECONDS.labels(kind="wait", **labels).set(steps["wait_seconds"])
        metrics.ENGINE_STEP_SECONDS.labels(kind="device", **labels).set(steps["device_seconds"])
        for part, seconds in steps["thread_seconds"].items():
            metrics.ENGINE_THREAD_SECONDS.labels(part=part, **labels).set(seconds)
        if steps["draft_tokens"] is not None:
            metrics.SPEC_TOKENS.labels(kind="draft", **labels).set(steps["draft_tokens"])
            metrics.SPEC_TOKENS.labels(kind="accepted", **labels).set(steps["accepted_tokens"])
            for i, rate in enumerate(steps["acceptance_by_position"]):
                metrics.SPEC_ACCEPTED_BY_POSITION.labels(position=str(i), **labels).set(rate)

    async def _report_kv_events(self, bus: EventBus, interval: float = 0.02) -> None:
        """KV events go out as soon as they exist, so placement learns of new
        prefixes within a step or two; a resync request is answered with a
        snapshot, in the same numbered stream."""
        resync = asyncio.Event()

        def on_resync(request: common_pb2.KvResync, headers) -> None:
            if request.worker_id in ("", self.config.worker_id):
                resync.set()

        await bus.subscribe(KV_RESYNC_SUBJECT, common_pb2.KvResync, on_resync)
        while True:
            if resync.is_set():
                resync.clear()
                batch = await self.reports.snapshot()
            else:
                batch = self.reports.kv_events()
            if batch is not None:
                await bus.publish(
                    kv_subject(self.config.worker_id),
                    common_pb2.KvEvents(
                        worker_id=self.config.worker_id,
                        event_id=batch.event_id,
                        stored=batch.stored,
                        removed=batch.removed,
                        host_stored=batch.host_stored,
                        host_removed=batch.host_removed,
                        reset=batch.reset,
                    ),
                )
            await asyncio.sleep(interval)
