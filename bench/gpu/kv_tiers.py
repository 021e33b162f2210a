"""Measurements of the KV cache's tiers, for bench/gpu/kvstore.py.

- `host_load`: the host tier's load path alone (HostTier.load of many blocks into
  the device cache), timed with device events, in GB/s; and the engine's own time
  to first token for a prompt recomputed and for a device hit, without the mesh;
- `ttft_by_tier`: one prompt's time to first token through a mesh with its prefix
  in no tier, on the device, in the host tier, and in the shared tier (after the
  worker was replaced: lent by the store's memory tier, or from Redis), each
  answer checked against the first; where a device hit's time goes, by the
  services' trace spans;
- `cross_worker`: the prompt computed on one of two workers and served by the
  other from the shared tier.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import torch

from bench.gpu.py_profile import Profile, children
from bench.gpu.timing import median_ms
from bench.otlp_receiver import OtlpReceiver, stages
from engine import LLM, SamplingParams
from yinian.mesh import Mesh
from yinian.mesh_probe import (
    http_get,
    list_workers,
    sample_sum,
    wait_store_mapped,
    worker_metric,
)


def host_load(
    folder, engine: dict, blocks: int, prompt: list[int] | None = None, profile: bool = False
) -> dict:
    """GB/s of loading `blocks` host-tier blocks into the device cache; with a
    prompt, the engine's time to first token for it recomputed and as a device hit
    (and, with `profile`, where this process's Python time goes over repeated hits)."""
    llm = LLM(folder, **engine)
    try:
        host = llm.engine.tiers.host
        blocks = min(blocks, host.pool.num_blocks, llm.engine.facts.num_kv_blocks - 1)
        slots = []
        for h in range(1, blocks + 1):
            slot = host.pool.begin_store(h)
            host.pool.end_store(slot)
            slots.append(slot)
        host.blocks[: len(slots)].view(torch.uint8).random_(0, 255)
        pairs = [(slot, 1 + i) for i, slot in enumerate(slots)]

        def load():
            for slot, _ in pairs:
                host.pool.pin(slot)
            host.load(pairs)
            host.poll(llm.engine.kv.pool, wait=True)

        ms = median_ms(load, str(llm.engine.facts.device.type))
        nbytes = blocks * host.bytes_per_block
        out = {"blocks": blocks, "bytes": nbytes, "ms": ms, "gbps": nbytes / ms / 1e6}
        if prompt is not None:
            out["engine_ttft"] = _engine_ttft(llm, prompt)
            if profile:
                one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
                with Profile({"engine": os.getpid()}, PROFILE_SECONDS) as p:
                    _repeat(lambda: llm.generate([prompt], one), PROFILE_SECONDS)
                out["engine_profile"] = p.top(PROFILE_FRAMES)
        return out
    finally:
        llm.close()


def _engine_ttft(llm: LLM, prompt: list[int]) -> dict:
    """The engine's own first token for `prompt`: recomputed (after a warm-up prompt of
    the same length), then as a device hit, REPEATS times (median kept)."""
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def timed(ids) -> float:
        start = time.perf_counter()
        llm.generate([ids], one)
        return (time.perf_counter() - start) * 1e3

    timed([(t + 1) % 1000 for t in prompt])  # the shapes, warmed up
    none = timed(prompt)
    hits = [timed(prompt) for _ in range(REPEATS)]
    short = [timed(SHORT_PROMPT) for _ in range(SHORT_REPEATS)]
    return {
        "none_ms": none,
        "gpu_ms": sorted(hits)[len(hits) // 2],
        "gpu_all_ms": hits,
        "short_prompt_ms": sorted(short)[len(short) // 2],
        "short_prompt_all_ms": short,
    }


# One client, its connection kept: a client made per request (httpx.stream) spends
# ~20 ms setting up before it sends, which is not the mesh's time.
_CLIENT = httpx.Client(timeout=600)
REPEATS = 3
# a prompt shorter than a block (never a prefix hit): the mesh's and the engine's
# first token for it, the fixed cost of a request
SHORT_PROMPT, SHORT_REPEATS = [11, 12, 13], 7
PROFILE_SECONDS, PROFILE_FRAMES = 4.0, 60


def _repeat(fn, seconds: float) -> int:
    """Calls fn again and again for `seconds`; how many times."""
    start, count = time.monotonic(), 0
    while time.monotonic() - start < seconds:
        fn()
        count += 1
    return count


def _first_token(mesh: Mesh, prompt: list[int], model: str, max_tokens: int = 4) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    ttft, text, cached = None, "", 0
    with _CLIENT.stream("POST", f"{mesh.url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                # the first token's chunk (its text may be empty: part of a character)
                if "text" in choice and ttft is None:
                    ttft = time.perf_counter() - start
                text += choice.get("text") or ""
            usage = chunk.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
    return {"ttft_ms": ttft * 1e3, "cached_tokens": cached, "text": text}


def ttft_by_tier(
    mesh: Mesh, model: str, prompt: list[int], fillers: list[list[int]], warm: list[int],
    traces: OtlpReceiver | None = None, profile: bool = False,
) -> dict:  # fmt: skip
    """The mesh has one worker whose device pool holds less than prompt + fillers,
    a host tier that holds them, and a KV store writing everything through (its
    services export their spans to `traces`, if given; with `profile`, where the
    worker's and the gateway's Python time goes over repeated device hits)."""
    out = {"prompt_tokens": len(prompt)}
    # an unrelated prompt of the same length first: "none" is then a recompute, not a
    # first run's warm-up
    out["warmup_ms"] = _first_token(mesh, warm, model)["ttft_ms"]
    # pinning the store's memory (seconds, in the background) is done before any hit
    out["mapped_seconds"] = [wait_store_mapped(mesh)]
    out["none"] = _first_token(mesh, prompt, model)
    out["settle_seconds"] = [_settle(mesh)]  # the prompt's blocks written through
    # a tier's first hit may meet shapes the engine has not run before: each hit is
    # taken REPEATS times (the host tier's after pushing the prompt out again) and the
    # median kept, every time recorded
    since = time.time_ns()
    gpu = [_first_token(mesh, prompt, model) for _ in range(REPEATS)]
    # the same with one token to make (the engine alone's case): no next step is queued
    # before the first token is read back
    out["gpu_one_token_ms"] = [_first_token(mesh, prompt, model, 1)["ttft_ms"]
                               for _ in range(REPEATS)]  # fmt: skip
    since_short = time.time_ns()
    short = [_first_token(mesh, SHORT_PROMPT, model, 1)["ttft_ms"] for _ in range(SHORT_REPEATS)]
    out["short_prompt_ms"], out["short_prompt_all_ms"] = sorted(short)[len(short) // 2], short
    if traces is not None:  # where a device hit's (and a short prompt's) time goes
        time.sleep(1.0)  # the services' span batches
        spans = traces.snapshot()
        out["gpu_stages"] = stages([s for s in spans if since <= s.start_ns < since_short])
        out["short_stages"] = stages([s for s in spans if s.start_ns >= since_short])
    if profile:
        names = ["worker-0", "gateway", "scheduler"]
        with Profile(children(mesh, names), PROFILE_SECONDS) as p:
            out["gpu_profile_hits"] = _repeat(
                lambda: _first_token(mesh, prompt, model), PROFILE_SECONDS
            )
        out["gpu_profile"] = p.top(PROFILE_FRAMES)
    host = []
    for _ in range(REPEATS):
        for filler in fillers:  # pushes the prompt out of the device pool, into the host tier
            _first_token(mesh, filler, model)
        out["settle_seconds"].append(_settle(mesh))
        host.append(_first_token(mesh, prompt, model))
    out["repeats_agree"] = all(len({r["text"] for r in rows}) == 1 for rows in (gpu, host))
    out["gpu"], out["gpu_all_ms"] = _median(gpu), [r["ttft_ms"] for r in gpu]
    out["host"], out["host_all_ms"] = _median(host), [r["ttft_ms"] for r in host]
    out["settle_seconds"].append(_settle(mesh))
    mesh.kill("worker-0")
    mesh.respawn("worker-0", timeout=1800)
    _wait_healthy(mesh)
    out["mapped_seconds"].append(wait_store_mapped(mesh))
    out["shared"] = _first_token(mesh, prompt, model)
    out["shared_fetched_tokens"] = _fetched(mesh)
    out["shared_fetched_by_path"] = {p: _fetched(mesh, p) for p in ("lent", "copied")}
    out["shared_fetch_ms"] = _fetch_ms(mesh)
    texts = {tier: out[tier].pop("text") for tier in ("none", "gpu", "host", "shared")}
    out["same_answer"] = len(set(texts.values())) == 1
    # which tier's answer differs (bf16 on random weights: near-tied logits can flip
    # between a whole prefill and a cached prefix's last block, tier or not)
    out["same_as_none"] = {t: texts[t] == texts["none"] for t in ("gpu", "host", "shared")}
    # a tier's blocks are whole when its hit answers as the device hit does (the same
    # computation: a cached prefix and the last block's prefill)
    out["same_as_gpu"] = {t: texts[t] == texts["gpu"] for t in ("host", "shared")}
    out["texts"] = texts
    none = out["none"]["ttft_ms"]
    out["speedup_over_none"] = {t: none / out[t]["ttft_ms"] for t in ("gpu", "host", "shared")}
    return out


def _fetched(mesh: Mesh, path: str = "") -> float:
    """Prompt tokens the workers fetched from the shared tier: lent (copied from the
    store's memory straight to the device), copied (into the host tier), or both."""
    where = f'path="{path}"' if path else ""
    return sum(worker_metric(mesh, "yinian:kv_shared_fetched_tokens_total", where=where).values())


def _fetch_ms(mesh: Mesh) -> float:
    """The workers' time in shared-tier lookups and fetches, in all (the prompt's is
    the only fetch a fresh worker made)."""
    return 1e3 * sum(worker_metric(mesh, "yinian:kv_shared_fetch_seconds_sum").values())


def _median(rows: list[dict]) -> dict:
    return sorted(rows, key=lambda r: r["ttft_ms"])[len(rows) // 2]


def _settle(mesh: Mesh, timeout: float = 120.0) -> float:
    """Waits until the worker's writes to the shared tier are done (none queued or in
    flight, none written or dropped since the last look), so that each TTFT is its
    tier's alone; returns the seconds waited. A request's blocks are queued before
    its last token is sent, so no write of a request that has ended comes later."""
    start = time.monotonic()

    def state() -> tuple[float, float]:
        done = pending = 0.0
        for w in list_workers(mesh):  # each worker's figures from one read of its page
            page = http_get(f"http://{w.info.metrics_address}/metrics").text
            done += sample_sum(page, "yinian:kv_shared_written_blocks_total")
            done += sample_sum(page, "yinian:kv_shared_dropped_blocks_total")
            pending += sample_sum(page, "yinian:kv_shared_pending_bytes")
        return done, pending

    last = state()
    while time.monotonic() - start < timeout:
        time.sleep(0.2)
        now = state()
        if now == last and now[1] == 0:
            break
        last = now
    return time.monotonic() - start


def _wait_healthy(mesh: Mesh, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if http_get(f"{mesh.url}/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the mesh did not become healthy again")


def cross_worker(mesh: Mesh, model: str, prompt: list[int], warm: list[list[int]]) -> dict:
    """The mesh has two workers and the default KV store. The prompt is computed
    on one worker and hit there once more (so the default write policy sends it
    down); that worker is then stopped, and the prompt served by the other from
    the shared tier. The answer is checked against the first."""
    out = {"mapped_seconds": wait_store_mapped(mesh)}
    for w in warm:  # both workers past their first prefill of this length
        _first_token(mesh, w, model)
    before = worker_metric(mesh, "yinian:prefix_cache_queried_tokens")
    out |= {"prompt_tokens": len(prompt), "none": _first_token(mesh, prompt, model)}
    out["gpu"] = _first_token(mesh, prompt, model)
    out["settle_seconds"] = _settle(mesh)
    # the worker that took both requests (its load reports carry the count: wait for them)
    deadline, first = time.monotonic() + 15, None
    while first is None and time.monotonic() < deadline:
        after = worker_metric(mesh, "yinian:prefix_cache_queried_tokens")
        first = next((w for w in after if after[w] - before.get(w, 0.0) >= 2 * len(prompt)), None)
        time.sleep(0.2)
    if first is None:
        raise RuntimeError("no worker took both requests of the prompt")
    out["computed_on"] = first
    out["written_blocks"] = worker_metric(mesh, "yinian:kv_shared_written_blocks_total")
    out["dropped_blocks"] = worker_metric(mesh, "yinian:kv_shared_dropped_blocks_total")
    mesh.kill(first)
    deadline = time.monotonic() + 60
    while any(w.info.worker_id == first for w in list_workers(mesh)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the scheduler still lists {first}")
        time.sleep(0.2)
    out["other"] = _first_token(mesh, prompt, model)
    out["fetched_tokens"] = _fetched(mesh)
    out["fetched_by_path"] = {p: _fetched(mesh, p) for p in ("lent", "copied")}
    out["fetch_ms"] = _fetch_ms(mesh)
    texts = {t: out[t].pop("text") for t in ("none", "gpu", "other")}
    out["same_answer"] = len(set(texts.values())) == 1
    out["same_as_gpu"] = texts["other"] == texts["gpu"]  # as in ttft_by_tier
    out["texts"] = texts
    out["other_over_none"] = out["other"]["ttft_ms"] / out["none"]["ttft_ms"]
    return out
