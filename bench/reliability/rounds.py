"""One round of a fault drill: concurrent streamed completions through the
gateways, a fault at a chosen moment, and what a client saw.

Each stream is one request of the load generator's client (bench/loadgen/
client.py). Its outcome, set beside a clean run of the same prompt: completed
and equal, completed but different (corrupted), ended with an error (failed),
or still open `join_timeout` seconds after the fault (hung). Meanwhile a probe
sends a small new request every `probe_interval` seconds from the fault on:
the recovery time runs from the fault to the end of the first probe that
succeeded after the last one that failed (0 when none failed; None when none
succeeded after it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.loadgen.client import RequestInput, send_request
from yinian.mesh_probe import default_tls


@dataclass
class Load:
    urls: list[str]  # gateways' REST addresses; stream i goes to urls[i % len(urls)]
    model: str
    prompts: list  # token id lists (or texts)
    max_tokens: int
    verify: object = True  # httpx's `verify` (an SSL context for a TLS mesh)


@dataclass
class Fault:
    name: str
    inject: Callable[[], None] | None  # runs in a thread; None: a clean round
    after_s: float = 2.0  # seconds after the streams were sent, at the latest
    # polled (in a thread) every 50 ms from then on: true brings the fault at once (a
    # round faster than the clean one must not end before its fault)
    due: Callable[[], bool] | None = None
    probe_url: str = ""  # where new requests are tried (default: the first gateway)
    lost_with: int | None = None  # index of a killed gateway: its connections die with it


@dataclass
class RoundResult:
    fault: str
    streams: int
    texts: list[str] = field(default_factory=list)
    open_at_fault: int = 0  # streams sent and not yet ended when the fault came
    completed: int = 0
    corrupted: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    lost_with_gateway: dict[int, str] = field(default_factory=dict)
    hung: list[int] = field(default_factory=list)
    probes: int = 0
    probe_failures: int = 0
    recovery_s: float | None = 0.0
    seconds: float = 0.0

    def summary(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "texts"}
        out["failed"] = {str(i): e[:300] for i, e in self.failed.items()}
        out["lost_with_gateway"] = {str(i): e[:200] for i, e in self.lost_with_gateway.items()}
        return out


def _client(load: Load, timeout: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    verify = default_tls() if load.verify is True else load.verify
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits, verify=verify)


def _request(url: str, load: Load, prompt, max_tokens: int) -> RequestInput:
    length = len(prompt) if isinstance(prompt, list) else 0
    return RequestInput(f"{url}/v1/completions", load.model, prompt, length, max_tokens)


async def _probe(load: Load, url: str, out: list, stop: asyncio.Event, interval: float) -> None:
    """Appends (sent, done, ok) of each probe until `stop`; a fresh connection each
    time, as a new client would open."""
    while not stop.is_set():
        sent = time.monotonic()
        async with _client(load, 5.0) as client:
            result = await send_request(client, _request(url, load, [11, 12, 13], 2))
        out.append((sent, time.monotonic(), result.success))
        await asyncio.sleep(interval)


def recovery(probes: list[tuple], fault_at: float) -> float | None:
    failed = [done for _, done, ok in probes if not ok]
    if not failed:
        return 0.0
    after = [done for sent, done, ok in probes if ok and sent >= failed[-1]]
    return after[0] - fault_at if after else None


async def run_round(
    load: Load,
    fault: Fault,
    clean: list[str] | None = None,
    join_timeout: float = 120.0,
    min_probe_s: float = 10.0,
    probe_interval: float = 0.2,
) -> RoundResult:
    """Runs every prompt once, concurrently, with `fault` injected on the way."""
    out = RoundResult(fault.name, len(load.prompts))
    begin = time.monotonic()
    async with _client(load, join_timeout + 60) as client:
        tasks = [
            asyncio.create_task(send_request(
                client, _request(load.urls[i % len(load.urls)], load, p, load.max_tokens)))
            for i, p in enumerate(load.prompts)
        ]  # fmt: skip
        fault_at = begin
        stop_probe = asyncio.Event()
        probe, probes = None, []
        if fault.inject is not None:
            deadline = time.monotonic() + fault.after_s
            while time.monotonic() < deadline:
                if fault.due is not None and await asyncio.to_thread(fault.due):
                    break
                await asyncio.sleep(0.05)
            fault_at = time.monotonic()
            url = fault.probe_url or load.urls[0]
            probe = asyncio.create_task(_probe(load, url, probes, stop_probe, probe_interval))
            await asyncio.to_thread(fault.inject)
        _, pending = await asyncio.wait(tasks, timeout=join_timeout)
        for task in pending:
            task.cancel()
        if probe is not None:
            # Probe on until the fault is min_probe_s old and the latest probe succeeded.
            while time.monotonic() < fault_at + min_probe_s or not (probes and probes[-1][2]):
                if time.monotonic() > fault_at + join_timeout:
                    break
                await asyncio.sleep(probe_interval)
            stop_probe.set()
            await probe
            out.probes = len(probes)
            out.probe_failures = sum(1 for *_, ok in probes if not ok)
            out.recovery_s = recovery(probes, fault_at)
    fault_perf = time.perf_counter() - (time.monotonic() - fault_at)
    for i, task in enumerate(tasks):
        if task in pending:
            out.hung.append(i)
            out.texts.append("")
            continue
        result = task.result()
        out.texts.append(result.generated_text)
        if result.start_time < fault_perf < result.start_time + result.latency:
            out.open_at_fault += 1
        if not result.success:
            lost = fault.lost_with is not None and i % len(load.urls) == fault.lost_with
            (out.lost_with_gateway if lost else out.failed)[i] = result.error
        elif clean is not None and result.generated_text != clean[i]:
            out.corrupted.append(i)
        else:
            out.completed += 1
    out.seconds = time.monotonic() - begin
    return out


def write_results(out: Path, results: dict, table: str) -> None:
    """Writes a drill's JSON to `out` and its table beside it (.md), and prints the table."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    out.with_suffix(".md").write_text(table)
    print(table)
