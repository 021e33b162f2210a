"""Streams through a running mesh while one of its workers is killed (`pd_nccl`'s kill
sections, and tests/mesh/test_pd_failures.py on the CPU).

`run_streams` starts one streaming completion per prompt, waits until some
have produced tokens, SIGKILLs the named child and waits for every stream to
end. Each result holds the text, the tokens and top logprobs as streamed (when
asked for), and the error that ended the stream, if any. `compare` sets them
beside a clean run: equal, or where they part and, from the clean run's top
logprobs, whether the other branch was its runner-up and by how much.
`kill_test` is the whole experiment: a clean run, a run with decode-0 killed,
each stream compared, and the prefill worker's leased blocks watched until freed.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import httpx
import torch

from yinian.mesh_probe import default_tls, gateway_metric, metric_sum


def stream_completion(
    url: str,
    model: str,
    prompt,
    max_tokens: int,
    logprobs: int | None = None,
    started: threading.Event | None = None,
    timeout: float = 120.0,
) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    if logprobs is not None:
        body["logprobs"] = logprobs
    text, tokens, top, error, chunks = "", [], [], None, 0
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=timeout, json=body,
                          verify=default_tls()) as resp:  # fmt: skip
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                payload = json.loads(line[6:])
                if "error" in payload:
                    error = payload["error"]["message"]
                    continue
                choice = payload["choices"][0]
                text += choice["text"]
                if choice.get("logprobs"):
                    tokens += choice["logprobs"]["tokens"]
                    top += choice["logprobs"]["top_logprobs"]
                chunks += 1
                if chunks >= 3 and started is not None:
                    started.set()
    except httpx.HTTPError as exc:
        error = f"transport: {exc}"
    return {"text": text, "tokens": tokens, "top_logprobs": top, "error": error}


def start_streams(
    one: Callable[[int], None], started: list[threading.Event], wait_started: int
) -> list[threading.Thread]:
    """Runs one(i) for every stream i (one per event of `started`) on a daemon thread;
    returns the threads once `wait_started` of the events are set, or after a minute."""
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(started))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while sum(e.is_set() for e in started) < wait_started and time.monotonic() < deadline:
        time.sleep(0.02)
    return threads


def run_streams(
    mesh,
    model: str,
    prompts: list,
    max_tokens: int,
    kill: str | None = None,
    wait_started: int = 0,
    delay: float = 0.0,
    logprobs: int | None = None,
    join_timeout: float = 120.0,
) -> tuple[list[dict], float, bool]:
    """(results in prompt order, seconds from the kill to the last stream's end,
    whether any stream was still open after `join_timeout`)."""
    results: dict[int, dict] = {}
    events = [threading.Event() for _ in prompts]

    def one(i: int) -> None:
        results[i] = stream_completion(
            mesh.url, model, prompts[i], max_tokens, logprobs, events[i], join_timeout
        )
        results[i]["ended"] = time.monotonic()

    threads = start_streams(one, events, wait_started)
    time.sleep(delay)
    if kill is not None:
        mesh.kill(kill)
    killed_at = time.monotonic()
    for t in threads:
        t.join(timeout=max(0.0, killed_at + join_timeout - time.monotonic()))
    hung = any(t.is_alive() for t in threads)
    empty = {"text": "", "tokens": [], "top_logprobs": [], "error": "still open (hung)"}
    out = [results.get(i, empty) for i in range(len(prompts))]
    for r in out:  # when each stream ended, from the kill (negative: before it)
        r["end_s"] = r.pop("ended", float("nan")) - killed_at
    return out, time.monotonic() - killed_at, hung


def compare(clean: dict, other: dict) -> dict:
    """Where `other`'s text leaves `clean`'s, in tokens of the clean run."""
    a, b = clean["text"], other["text"]
    if other["error"]:
        return {"equal": False, "error": other["error"]}
    if a == b:
        return {"equal": True}
    char = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    at, offset = len(clean["tokens"]), 0
    for j, tok in enumerate(clean["tokens"]):
        if offset + len(tok) > char:
            at = j
            break
        offset += len(tok)
    row = {"equal": False, "diverged_at_token": at, "gap": None, "runner_up": False}
    if at < len(clean["top_logprobs"]):
        top = clean["top_logprobs"][at]
        ranked = sorted(top.items(), key=lambda kv: -kv[1])
        rest = b[offset:]
        for tok, lp in ranked[1:]:
            if tok and rest.startswith(tok):  # the other branch took the runner-up
                row.update(runner_up=True, gap=ranked[0][1] - lp)
                break
    return row


def kill_test(mesh, model: str, streams: int, max_tokens: int, vocab: int = 500) -> dict:
    """Streams through the gateway, decode-0 SIGKILLed once a quarter have tokens; each
    stream set beside a clean run of the same prompts. None may hang, and the prefill
    worker's leased blocks must come back."""
    g = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(0, vocab, (200 + 50 * i,), generator=g).tolist() for i in range(streams)
    ]
    clean, _, clean_hung = run_streams(mesh, model, prompts, max_tokens, logprobs=2)
    t0 = time.monotonic()
    killed, elapsed, hung = run_streams(
        mesh, model, prompts, max_tokens, kill="decode-0", wait_started=max(1, streams // 4)
    )
    rows = [compare(c, k) for c, k in zip(clean, killed)]
    leases_freed_s = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if metric_sum(mesh, "yinian:kv_cache_usage_ratio", role="prefill") == 0:
            leases_freed_s = time.monotonic() - t0
            break
        time.sleep(0.5)
    return {
        "streams": streams,
        "max_tokens": max_tokens,
        "clean_errors": [c["error"] for c in clean if c["error"]],
        "clean_hung": clean_hung,
        "equal": sum(r["equal"] for r in rows),
        "errors": [r["error"] for r in rows if "error" in r],
        "diverged": [dict(r, stream=i) for i, r in enumerate(rows) if not r["equal"]],
        "hung": hung,
        "seconds_after_kill": elapsed,
        "stream_end_s": [round(r["end_s"], 3) for r in killed],
        "prefill_blocks_released": leases_freed_s is not None,
        "prefill_usage_zero_after_s": leases_freed_s,
        "migrations": gateway_metric(mesh, "yinian:request_migrations_total"),
    }
