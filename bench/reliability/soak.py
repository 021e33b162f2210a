"""The soak: mixed traffic through a CPU mesh for a long time (30 minutes by
default), every service's memory sampled as it runs.

Traffic, from `--concurrency` clients at once: streamed and whole completions
and chat completions of varied lengths, prompts that share a system prefix
(prefix cache, shared tier), and clients that leave mid-stream (aborts). The
goal: after the warm-up (the first fifth of the run), no service's resident
memory grows by more than 5% (the median of the last three samples against the
median of the first three after warm-up). Every cache is given a bound that the
warm-up fills (device KV blocks, the host tier, the shared tier): memory that
only fills a preallocated cache is not growth. Not part of the test suite.

Usage: python -m bench.reliability.soak [--minutes 30] [--concurrency 8]
           [--warmup SECONDS] [--out bench/results/soak.json]
Writes the JSON (every sample) and, beside it, the table (soak.md).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.loadgen.client import RequestInput, hang_up_after, send_request
from bench.reliability.chaos import tiny_model
from bench.reliability.rounds import write_results
from yinian.mesh import Mesh, MeshSpec

GROWTH_GOAL = 0.05
SHARED_TIER_BYTES = 8 << 20
# 1024 blocks of 16 tokens (8 MiB on tiny-llama) and a 20 MiB host tier: both are
# cycled through within the warm-up (by default the host tier may take GiBs).
ENGINE_ARGV = ["--device", "cpu", "--num-gpu-blocks", "1024", "--host-kv-cache-gb", "0.02"]
SYSTEM = "You are a careful assistant. Answer briefly and cite the section you used. " * 4


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def sample(mesh: Mesh) -> dict[str, tuple[int, int]]:
    """service -> (pid, resident bytes)."""
    out = {}
    for child in mesh.children:
        try:
            out[child.name] = (child.proc.pid, rss_bytes(child.proc.pid))
        except OSError:
            out[child.name] = (child.proc.pid, 0)
    return out


def one_request(url: str, rng: random.Random) -> RequestInput:
    kind = rng.choice(("stream", "stream", "chat", "shared_prefix", "long"))
    output = rng.choice((8, 32, 64, 128))
    if kind == "chat":
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"question {rng.randrange(10**6)}"}]  # fmt: skip
        return RequestInput(f"{url}/v1/chat/completions", "tiny-llama", "", 0, output,
                            chat=True, messages=messages)  # fmt: skip
    if kind == "shared_prefix":
        prompt = SYSTEM + f" case {rng.randrange(50)}"
    elif kind == "long":
        prompt = [rng.randrange(500) for _ in range(rng.randrange(300, 900))]
    else:
        prompt = f"note {rng.randrange(10**6)}: " + "word " * rng.randrange(5, 60)
    return RequestInput(f"{url}/v1/completions", "tiny-llama", prompt, 0, output)


async def leave_early(client: httpx.AsyncClient, url: str) -> None:
    """A client that reads a few events of a long stream and hangs up."""
    body = {"model": "tiny-llama", "prompt": "a long story", "max_tokens": 500,
            "stream": True, "ignore_eos": True}  # fmt: skip
    await hang_up_after(client, f"{url}/v1/completions", body, events=3)


async def traffic(url: str, seconds: float, concurrency: int, counts: dict) -> None:
    async def client_loop(k: int) -> None:
        rng = random.Random(k)
        async with httpx.AsyncClient(timeout=120) as client:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                if rng.random() < 0.1:
                    try:
                        await leave_early(client, url)
                        counts["left_early"] += 1
                    except httpx.HTTPError:
                        counts["errors"] += 1
                    continue
                result = await send_request(client, one_request(url, rng))
                if result.success:
                    counts["ok"] += 1
                elif result.finished and result.status_code == 200:
                    # the model's whole answer decodes to no text (special tokens,
                    # an immediate end of sequence): served, not lost
                    counts["empty_answers"] += 1
                    if len(counts["empty_samples"]) < 10:
                        counts["empty_samples"].append(result.error[:300])
                    continue
                else:
                    counts["errors"] += 1
                if not result.success and len(counts["error_samples"]) < 10:
                    counts["error_samples"].append(result.error[:300])

    await asyncio.gather(*(client_loop(k) for k in range(concurrency)))


def served(counts: dict) -> int:
    return counts["ok"] + counts["empty_answers"] + counts["errors"]


def growth(samples: list[dict], name: str, warmup_at: float) -> dict:
    after = [s for s in samples if s["t"] >= warmup_at]
    first = statistics.median(s["rss"][name][1] for s in after[:3])
    last = statistics.median(s["rss"][name][1] for s in after[-3:])
    pids = {s["rss"][name][0] for s in samples}
    grew = (last - first) / first if first else None
    return {"after_warmup_mib": first / 2**20, "end_mib": last / 2**20, "growth": grew,
            "restarts": len(pids) - 1,
            "met": grew is not None and grew < GROWTH_GOAL and len(pids) == 1}  # fmt: skip


def table(result: dict) -> str:
    lines = ["| service | RSS after warm-up (MiB) | RSS at end (MiB) | growth | goal < 5% |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name, g in result["services"].items():
        met = "met" if g["met"] else "MISSED"
        lines.append(f"| {name} | {g['after_warmup_mib']:.1f} | {g['end_mib']:.1f} "
                     f"| {100 * g['growth']:+.2f}% | {met} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="length of the run")
    parser.add_argument("--concurrency", type=int, default=8, help="clients at once")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    parser.add_argument(
        "--warmup",
        type=float,
        help="seconds before growth is measured (default: a fifth of the run)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    args = parser.parse_args(argv)
    seconds = args.minutes * 60
    counts = {"ok": 0, "empty_answers": 0, "errors": 0, "left_early": 0,
              "error_samples": [], "empty_samples": []}  # fmt: skip
    samples: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        model = tiny_model(Path(tmp) / "tiny-llama")
        spec = MeshSpec(model=str(model), workers=1, prefill=1, decode=1, kvstore=True,
                        port=0, engine_argv=ENGINE_ARGV,
                        scheduler_argv=["--disagg-min-tokens", "256"],
                        # A shared tier that fills up during the warm-up and then
                        # evicts: Redis holds what the store allows, no more.
                        kvstore_argv=["--capacity-bytes", str(SHARED_TIER_BYTES)],
                        log_dir=Path(tmp) / "logs")  # fmt: skip
        with Mesh(spec) as mesh:

            async def run() -> None:
                begin = time.monotonic()
                load = asyncio.create_task(traffic(mesh.url, seconds, args.concurrency, counts))
                while not load.done():
                    samples.append({"t": time.monotonic() - begin, "rss": sample(mesh),
                                    "requests": served(counts)})  # fmt: skip
                    await asyncio.wait({load}, timeout=args.interval)
                samples.append({"t": time.monotonic() - begin, "rss": sample(mesh),
                                "requests": served(counts)})  # fmt: skip
                await load

            asyncio.run(run())
    warmup_at = args.warmup if args.warmup is not None else seconds / 5
    names = list(samples[0]["rss"])
    result = {"minutes": args.minutes, "concurrency": args.concurrency,
              "warmup_s": warmup_at, "goal": f"growth after warm-up < {GROWTH_GOAL:.0%}",
              "requests": counts, "services": {n: growth(samples, n, warmup_at) for n in names},
              "samples": samples}  # fmt: skip
    result["met"] = all(g["met"] for g in result["services"].values())
    write_results(args.out, result, table(result))
    print(f"requests: {counts['ok']} ok, {counts['empty_answers']} empty answers, "
          f"{counts['errors']} errors, {counts['left_early']} left early")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
