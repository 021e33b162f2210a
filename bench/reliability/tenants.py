"""Tenant isolation, measured: the latency tenant B sees alone, while tenant A floods
the gateway far beyond its limits (A gets 429s), and, for contrast, while A floods
with no limits at all (the same limits file, emptied and reloaded with SIGHUP).

A floods open-loop: `--flood-rate` requests per second whatever the answers, against
a limit of `--a-rpm` requests per minute and `--a-concurrent` at once. B sends
`--requests` requests one after another. Not part of the test suite.

Usage: python -m bench.reliability.tenants [--requests 40] [--flood-rate 40]
           [--out bench/results/tenants.json]
Writes the JSON and, beside it, the table (tenants.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.loadgen.metrics import nearest_rank
from bench.reliability.chaos import tiny_model
from bench.reliability.rounds import write_results
from yinian.mesh import Mesh, MeshSpec

KEY_A, KEY_B = "sk-bench-tenant-a", "sk-bench-tenant-b"
BODY = {"model": "tiny-llama", "max_tokens": 16, "temperature": 0, "ignore_eos": True}


async def tenant_b(client: httpx.AsyncClient, count: int) -> dict:
    latencies, statuses = [], Counter()
    for i in range(count):
        start = time.perf_counter()
        resp = await client.post("/v1/completions", json=BODY | {"prompt": f"calm {i}"},
                                 headers={"Authorization": f"Bearer {KEY_B}"})  # fmt: skip
        latencies.append(time.perf_counter() - start)
        statuses[resp.status_code] += 1
    return {"p50_s": statistics.median(latencies), "p90_s": nearest_rank(latencies, 0.9),
            "mean_s": statistics.mean(latencies), "requests": count,
            "statuses": dict(statuses)}  # fmt: skip


async def phase(url: str, count: int, flood_rate: float) -> dict:
    """B's latencies, with A flooding at `flood_rate` requests/s (0: A idle)."""
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        flood_statuses: Counter = Counter()
        done = asyncio.Event()

        async def one(i: int) -> None:
            try:
                resp = await client.post(
                    "/v1/completions", json=BODY | {"prompt": f"flood {i}"},
                    headers={"Authorization": f"Bearer {KEY_A}"},
                )  # fmt: skip
                flood_statuses[resp.status_code] += 1
            except httpx.HTTPError as exc:
                flood_statuses[type(exc).__name__] += 1

        async def flood() -> None:
            tasks, i = [], 0
            start = time.perf_counter()
            while not done.is_set():
                tasks.append(asyncio.create_task(one(i)))
                i += 1
                await asyncio.sleep(max(0.0, start + i / flood_rate - time.perf_counter()))
            await asyncio.gather(*tasks)

        flooder = asyncio.create_task(flood()) if flood_rate > 0 else None
        if flooder is not None:
            await asyncio.sleep(2.0)  # the flood is under way, A's buckets spent
        b = await tenant_b(client, count)
        done.set()
        if flooder is not None:
            await flooder
        b["a_statuses"] = {str(k): v for k, v in sorted(flood_statuses.items(), key=str)}
        return b


def table(results: dict) -> str:
    lines = ["| tenant B's requests | p50 (ms) | p90 (ms) | B's answers | A's answers |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name, r in results["phases"].items():
        lines.append(f"| {name} | {r['p50_s'] * 1000:.0f} | {r['p90_s'] * 1000:.0f} | "
                     f"{r['statuses']} | {r.get('a_statuses', {})} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40, help="tenant B's requests per phase")
    parser.add_argument("--flood-rate", type=float, default=40.0, help="A's requests per second")
    parser.add_argument("--a-rpm", type=float, default=120.0, help="A's requests per minute")
    parser.add_argument("--a-concurrent", type=int, default=4, help="A's requests at once")
    parser.add_argument("--out", type=Path, default=Path("bench/results/tenants.json"))
    args = parser.parse_args(argv)
    a_limits = {"requests_per_minute": args.a_rpm, "burst": 10,
                "max_concurrent": args.a_concurrent}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tenants-") as tmp:
        keys, limits = Path(tmp) / "keys.txt", Path(tmp) / "limits.json"
        keys.write_text(f"{KEY_A} tenant-a\n{KEY_B} tenant-b\n")
        limits.write_text(json.dumps({"tenant-a": a_limits}))
        spec = MeshSpec(model=str(tiny_model(Path(tmp) / "tiny-llama")), workers=1,
                        port=0, engine_argv=["--device", "cpu"],
                        gateway_argv=["--api-keys", str(keys), "--tenant-limits", str(limits)],
                        log_dir=Path(tmp) / "logs")  # fmt: skip
        with Mesh(spec) as mesh:
            asyncio.run(phase(mesh.url, 8, 0))  # warm-up
            phases = {"alone": asyncio.run(phase(mesh.url, args.requests, 0))}
            phases["while A floods, A limited"] = asyncio.run(
                phase(mesh.url, args.requests, args.flood_rate)
            )
            limits.write_text("{}")
            mesh.child("gateway").proc.send_signal(signal.SIGHUP)
            time.sleep(1.0)
            phases["while A floods, no limits"] = asyncio.run(
                phase(mesh.url, args.requests, args.flood_rate)
            )
    results = {
        "phases": phases,
        "setup": {"mesh": "tiny-llama on CPU: 1 colocated worker, scheduler, gateway, NATS",
                  "b_requests": args.requests, "flood_rate_per_s": args.flood_rate,
                  "a_limits": a_limits, "max_tokens": BODY["max_tokens"]},
    }  # fmt: skip
    write_results(args.out, results, table(results))
    return results


if __name__ == "__main__":
    main()
