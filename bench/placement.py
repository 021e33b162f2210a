"""How long the scheduler takes to place one request, against how many workers it
chooses from: the scheduler's own placement (`services/common/placement.py`)
over a registry of N ready workers and a KV index fed as the workers' events feed
it, in process, no network. Each worker holds in its GPU tier a shared system
prompt and the histories of the conversations it served (some pushed down to its
host tier); the requests are next turns of those conversations and fresh prompts
with the system prompt, placed one after another, each counted as placed (its
worker's load goes up by one, and load reports bring it back, as between two
reports of a real mesh). A report's cost (the scheduler updating its open
workers' loads, `placement.OpenWorkers`) is the report's, not a placement's: it
is not timed.

Usage: python -m bench.placement --out bench/results/placement_cpu.json
           [--workers 10,100,1000] [--requests 2000] [--prompt-blocks 64]
Prints, per worker count, the placement time p50 / p99 / max in µs.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from services.common.kv_index import GPU, HOST, KvIndex
from services.common.placement import PlacementPolicy, place
from services.common.registry import Registry, WorkerState

SYSTEM_BLOCKS = 32  # the shared system prompt (512 tokens of 16)
CONVERSATIONS_PER_WORKER = 8
REPORT_EVERY = 16  # placements between two load reports of a worker


def build(workers: int, prompt_blocks: int, seed: int):
    rng = random.Random(seed)
    registry, index = Registry(heartbeat_timeout=1e9), KvIndex()
    system = [rng.getrandbits(63) for _ in range(SYSTEM_BLOCKS)]
    conversations = []
    for w in range(workers):
        wid = f"worker-{w}"
        registry.register(WorkerState(wid, f"10.0.{w // 256}.{w % 256}:50061", "colocated",
                                      block_size=16, max_num_seqs=256))  # fmt: skip
        gpu, host = list(system), []
        for _ in range(CONVERSATIONS_PER_WORKER):
            history = system + [rng.getrandbits(63) for _ in range(prompt_blocks - SYSTEM_BLOCKS)]
            conversations.append(history)
            cut = rng.randrange(SYSTEM_BLOCKS, prompt_blocks)  # the rest went to the host tier
            gpu += history[SYSTEM_BLOCKS:cut]
            host += history[cut:]
        index.apply(wid, 0, {GPU: (gpu, []), HOST: (host, [])}, reset=True)
        registry.on_load(wid, rng.randrange(0, 64), 0, rng.random() * 0.8)
    return registry, index, system, conversations


def measure(workers: int, requests: int, prompt_blocks: int, seed: int = 0) -> dict:
    registry, index, system, conversations = build(workers, prompt_blocks, seed)
    rng = random.Random(seed + 1)
    policy = PlacementPolicy()
    times, matched = [], 0
    for i in range(requests):
        if rng.random() < 0.5:  # a next turn: its history and a new message
            history = rng.choice(conversations)
            hashes = history + [rng.getrandbits(63) for _ in range(4)]
        else:  # a new conversation: the system prompt and a first message
            hashes = system + [rng.getrandbits(63) for _ in range(prompt_blocks - SYSTEM_BLOCKS)]
        began = time.perf_counter()
        decision = place(registry, index, policy, hashes, len(hashes) * 16)
        times.append(time.perf_counter() - began)
        matched += decision.matched_blocks
        if i % REPORT_EVERY == 0:  # load reports: every worker's pending placements counted
            for w in list(registry.workers.values()):
                registry.on_load(w.worker_id, w.running + w.pending, w.waiting, w.kv_usage)
    times.sort()
    us = [t * 1e6 for t in times]
    return {
        "workers": workers,
        "requests": requests,
        "prompt_blocks": prompt_blocks,
        "p50_us": statistics.median(us),
        "p99_us": us[int(0.99 * (len(us) - 1))],
        "max_us": us[-1],
        "mean_matched_blocks": matched / requests,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workers", default="10,100,1000")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--prompt-blocks", type=int, default=64)
    args = parser.parse_args(argv)
    rows = []
    for n in (int(x) for x in args.workers.split(",")):
        row = measure(n, args.requests, args.prompt_blocks)
        rows.append(row)
        print(f"{n:>6} workers: placement p50 {row['p50_us']:8.1f} µs, p99 {row['p99_us']:8.1f} µs,"
              f" max {row['max_us']:8.1f} µs; matched {row['mean_matched_blocks']:.1f} blocks",
              flush=True)  # fmt: skip
    result = {"script": "placement", "python": platform.python_version(),
              "machine": platform.processor() or platform.machine(), "rows": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
