"""Measurements of the KV cache's tiers, for bench/gpu/kvstore.py.

- `host_load`: the host tier's load path alone (HostTier.load of many blocks into
  the device cache), timed with device events, in GB/s;
- `ttft_by_tier`: one prompt's time to first token through a mesh with its prefix
  in no tier, on the device, in the host tier, and in the shared tier (Redis,
  after the worker was replaced), each answer checked against the first.
"""

from __future__ import annotations

import json
import time

import httpx
import torch

from bench.gpu.timing import median_ms
from engine import LLM
from yinian.mesh import Mesh
from yinian.mesh_probe import worker_metric


def host_load(folder, engine: dict, blocks: int) -> dict:
    """GB/s of loading `blocks` host-tier blocks into the device cache."""
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
        return {"blocks": blocks, "bytes": nbytes, "ms": ms, "gbps": nbytes / ms / 1e6}
    finally:
        llm.close()


# One client, its connection kept: a client made per request (httpx.stream) spends
# ~20 ms setting up before it sends, which is not the mesh's time.
_CLIENT = httpx.Client(timeout=600)


def _first_token(mesh: Mesh, prompt: list[int], model: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
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
                if choice.get("text") and ttft is None:
                    ttft = time.perf_counter() - start
                text += choice.get("text") or ""
            usage = chunk.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
    return {"ttft_ms": ttft * 1e3, "cached_tokens": cached, "text": text}


def ttft_by_tier(mesh: Mesh, model: str, prompt: list[int], fillers: list[list[int]]) -> dict:
    """The mesh has one worker whose device pool holds less than prompt + fillers,
    a host tier that holds them, and a KV store writing everything through."""
    out = {"prompt_tokens": len(prompt)}
    out["none"] = _first_token(mesh, prompt, model)
    out["settle_seconds"] = [_settle(mesh)]  # the prompt's blocks written through
    out["gpu"] = _first_token(mesh, prompt, model)
    for filler in fillers:  # pushes the prompt out of the device pool, into the host tier
        _first_token(mesh, filler, model)
    out["settle_seconds"].append(_settle(mesh))
    out["host"] = _first_token(mesh, prompt, model)
    out["settle_seconds"].append(_settle(mesh))
    mesh.kill("worker-0")
    mesh.respawn("worker-0", timeout=1800)
    _wait_healthy(mesh)
    out["shared"] = _first_token(mesh, prompt, model)
    out["shared_fetched_tokens"] = sum(
        worker_metric(mesh, "yinian:kv_shared_fetched_tokens_total").values()
    )
    texts = {tier: out[tier].pop("text") for tier in ("none", "gpu", "host", "shared")}
    out["same_answer"] = len(set(texts.values())) == 1
    # which tier's answer differs (bf16 on random weights: near-tied logits can flip
    # between a whole prefill and a cached prefix's last block, tier or not)
    out["same_as_none"] = {t: texts[t] == texts["none"] for t in ("gpu", "host", "shared")}
    none = out["none"]["ttft_ms"]
    out["speedup_over_none"] = {t: none / out[t]["ttft_ms"] for t in ("gpu", "host", "shared")}
    return out


def _settle(mesh: Mesh, quiet: float = 1.0, timeout: float = 120.0) -> float:
    """Waits until the worker's writes to the shared tier have stopped (no block
    written or dropped for `quiet` seconds), so that each TTFT is its tier's alone;
    returns the seconds waited."""
    start = time.monotonic()

    def count() -> float:
        return sum(worker_metric(mesh, "yinian:kv_shared_written_blocks_total").values()) + sum(
            worker_metric(mesh, "yinian:kv_shared_dropped_blocks_total").values()
        )

    last, since = count(), time.monotonic()
    while time.monotonic() - start < timeout:
        time.sleep(0.2)
        now = count()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
    return time.monotonic() - start


def _wait_healthy(mesh: Mesh, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{mesh.url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the mesh did not become healthy again")
