"""What the mesh adds to a request, measured on any machine: the same mock engine
(`--model-runner mock`: no weights, each step sleeps its modelled time) driven
in this process through `AsyncLLM`, then as the one worker of a mesh behind the
gateway and the scheduler, at each concurrency (closed loop: every client sends
its next request when its last one ends; at least --min-requests requests a
concurrency).

First the floor under each hop on this machine (bench/grpc_floor.py: a bare
unary gRPC round trip between two processes, busy and idle; bench/http_floor.py:
a streamed POST's first event from a bare FastAPI app on the gateway's server
stack): a lone request through the mesh makes both hops, the engine alone
neither. Per concurrency:
time to first token (send → the first chunk that carries a
token) and time per output token after it (the rest of the stream over the
tokens after the first), percentiles over every request, the engine alone and
through the mesh, and their differences; and each service's CPU use during the
mesh's run, in cores.

`--stagger S`: client c sends its first request c/concurrency of S seconds after
the start, in both runs (by default every client starts at once, so each round's
requests arrive together and the mesh's per-request work spreads them out while
the engine alone takes them into one step).

`--long-output-len N`: each concurrency also runs through the mesh with N tokens a
request, and each service's CPU a request is split into what a request costs
whatever its length and what each further streamed token costs (the slope between
the two lengths: `cpu_us_per_extra_token`, `cpu_ms_per_request_fixed`), since the
CPU over the tokens of short requests is mostly per-request work. The engine alone is
split the same way (this process's CPU: the engine thread and the consumer of its
streams), and `mesh_added_us_per_extra_token` is the mesh's processes' slope less the
engine alone's: what a further streamed token costs the mesh beyond the engine.

Usage: python -m bench.mesh_overhead [--concurrency 1,64,512] [--rounds 3]
           [--step-ms 5] [--token-us 20] [--traces] [--no-worker-links]
           [--placement auto|gateway|scheduler] [--stagger SECONDS]
           [--output-len 32] [--long-output-len 256]
           [--min-requests 32] [--floor-calls 300] [--out bench/results/mesh_overhead.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import h11
import psutil

from bench import grpc_floor, http_floor
from bench.otlp_receiver import OtlpReceiver, stages
from bench.reliability.chaos import tiny_model
from engine import SamplingParams
from engine.async_llm import AsyncLLM
from yinian.mesh import Mesh, MeshSpec

PROMPT_LEN = 128


def prompts(count: int, vocab: int = 500, seed: int = 0) -> list[list[int]]:
    """Distinct prompts (no two share a first block: no prefix hits between them)."""
    return [[(7 * i + 13 * j + i * j + seed * 101) % vocab for j in range(PROMPT_LEN)]
            for i in range(count)]  # fmt: skip


def timing(sent: float, token_times: list[float], output_len: int) -> dict:
    ttft = token_times[0] - sent
    rest = (token_times[-1] - token_times[0]) / max(1, output_len - 1)
    return {"ttft": ttft, "tpot": rest, "tokens": len(token_times)}


async def engine_request(llm: AsyncLLM, rid: str, prompt: list[int], output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    sent, times = time.perf_counter(), []
    async for out in llm.generate(prompt, params, rid, delta=True):
        now = time.perf_counter()
        times.extend([now] * len(out.outputs[0].token_ids))
    if len(times) != output_len:
        raise RuntimeError(f"the engine made {len(times)} tokens of {output_len}")
    return timing(sent, times, output_len)


class MeshClient:
    """One keep-alive HTTP/1.1 connection to the gateway (h11 over asyncio streams: a
    client light enough to leave the cores to the mesh), its requests one at a time."""

    def __init__(self, host: str, port: int, model: str, output_len: int):
        self.host, self.port, self.model, self.output_len = host, port, model, output_len
        self.reader = self.writer = None

    async def send(self, rid: str, prompt: list[int]) -> dict:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": self.output_len,
                           "temperature": 0, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()  # fmt: skip
        conn = h11.Connection(h11.CLIENT)
        headers = [("host", self.host), ("content-type", "application/json"),
                   ("content-length", str(len(body)))]  # fmt: skip
        sent, times, made, pending = time.perf_counter(), [], 0, b""
        self.writer.write(conn.send(h11.Request(method="POST", target="/v1/completions",
                                                headers=headers)))  # fmt: skip
        self.writer.write(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await self.reader.read(65536))
                continue
            if isinstance(event, h11.Response) and event.status_code != 200:
                raise RuntimeError(f"HTTP {event.status_code}")
            if isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
            if not isinstance(event, h11.Data):
                continue
            now = time.perf_counter()
            *events, pending = (pending + bytes(event.data)).split(b"\n\n")
            for line in events:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                made = (chunk.get("usage") or {}).get("completion_tokens", made)
                for choice in chunk.get("choices") or []:
                    if choice.get("text") or choice.get("finish_reason") is None:
                        times.append(now)  # a token's chunk (the closing one may carry none)
        if made != self.output_len or not times:
            raise RuntimeError(f"a stream made {made} tokens of {self.output_len}")
        return timing(sent, times, self.output_len)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class EngineClient:
    def __init__(self, llm: AsyncLLM, output_len: int):
        self.llm, self.output_len = llm, output_len

    async def send(self, rid: str, prompt: list[int]) -> dict:
        return await engine_request(self.llm, rid, prompt, self.output_len)


async def closed_loop(clients: list, rounds: int, seed: int,
                      stagger: float = 0.0) -> tuple[list[dict], float]:  # fmt: skip
    """Every client sends `rounds` requests, one after another (client c's first after
    c/len(clients) of `stagger` seconds: spread over it, not all at once); all
    results, and the wall time."""
    todo = prompts(len(clients) * rounds, seed=seed)

    async def run(c: int) -> list[dict]:
        send = clients[c].send
        await asyncio.sleep(stagger * c / len(clients))
        return [await send(f"r{c}-{r}", todo[c * rounds + r]) for r in range(rounds)]

    start = time.perf_counter()
    rows = await asyncio.gather(*(run(c) for c in range(len(clients))))
    return [row for per in rows for row in per], time.perf_counter() - start


def summary(rows: list[dict]) -> dict:
    def pct(key: str, q: float) -> float:
        values = sorted(r[key] for r in rows)
        return values[min(len(values) - 1, int(q * len(values)))] * 1e3

    return {"requests": len(rows), "ttft_p50_ms": pct("ttft", 0.5),
            "ttft_p99_ms": pct("ttft", 0.99), "tpot_p50_ms": pct("tpot", 0.5),
            "tpot_p99_ms": pct("tpot", 0.99)}  # fmt: skip


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for name, pid in pids.items():
        t = psutil.Process(pid).cpu_times()
        out[name] = t.user + t.system
    return out


async def engine_alone(folder: Path, options: dict, concurrency: int, rounds: int, seed: int,
                       output_len: int, stagger: float = 0.0):  # fmt: skip
    """Rows, and this process's CPU seconds a request (the engine thread and the
    in-process consumer of its streams: what the worker's process does beside its
    service)."""
    llm = AsyncLLM.from_model(str(folder), **options)
    try:
        await engine_request(llm, "warm-up", prompts(1, seed=1)[0], output_len)  # not counted
        before = time.process_time()
        rows, _ = await closed_loop([EngineClient(llm, output_len)] * concurrency, rounds, seed,
                                    stagger)  # fmt: skip
        return rows, (time.process_time() - before) / len(rows)
    finally:
        llm.shutdown()


async def through_mesh(url: str, model: str, concurrency: int, rounds: int, seed: int,
                       output_len: int, stagger: float = 0.0):  # fmt: skip
    host, port = url.split("//")[1].split("/")[0].split(":")
    warm = MeshClient(host, int(port), model, output_len)
    await warm.send("warm-up", prompts(1, seed=1)[0])  # not counted
    warm.close()
    clients = [MeshClient(host, int(port), model, output_len) for _ in range(concurrency)]
    try:
        return await closed_loop(clients, rounds, seed, stagger)
    finally:
        for client in clients:
            client.close()


def per_token_split(short: dict, short_len: int, long: dict, long_len: int) -> dict:
    """Each service's CPU a request at two output lengths, split into the slope (µs a
    further streamed token) and the intercept (ms a request whatever its length)."""
    slope = {n: (long[n] - short[n]) / (long_len - short_len) for n in short}
    return {"cpu_us_per_extra_token": {n: v * 1e6 for n, v in slope.items()},
            "cpu_ms_per_request_fixed": {n: (short[n] - slope[n] * short_len) * 1e3
                                         for n in short}}  # fmt: skip


def engine_argv(args) -> list[str]:
    return ["--model-runner", "mock", "--mock-step-ms", str(args.step_ms),
            "--mock-token-us", str(args.token_us), "--max-num-seqs", "512",
            "--num-gpu-blocks", "16384"]  # fmt: skip


def run(args, folder: Path) -> dict:
    options = {"model_runner": "mock", "mock_step_ms": args.step_ms,
               "mock_token_us": args.token_us, "max_num_seqs": 512,
               "num_gpu_blocks": 16384}  # fmt: skip
    results = {"step_ms": args.step_ms, "token_us": args.token_us, "prompt_len": PROMPT_LEN,
               "stagger_s": args.stagger,
               "output_len": args.output_len, "long_output_len": args.long_output_len,
               "rounds": args.rounds, "by_concurrency": []}  # fmt: skip
    # the floor under each hop on this machine, in the same run
    results["grpc_floor"] = grpc_floor.measure(args.floor_calls)
    results["http_floor"] = http_floor.measure(args.floor_calls)
    print(json.dumps({k: results[k] for k in ("grpc_floor", "http_floor")}), flush=True)
    traces = OtlpReceiver().start() if args.traces else None
    env = {} if traces is None else {"OTEL_EXPORTER_OTLP_ENDPOINT": traces.endpoint,
                                     "OTEL_BSP_SCHEDULE_DELAY": "200"}  # fmt: skip
    if not args.worker_links:  # the gateway makes one Generate call a request
        env["YINIAN_WORKER_LINKS"] = "false"
    results["worker_links"] = args.worker_links
    results["placement"] = args.placement
    spec = MeshSpec(model=str(folder), workers=1, port=0, engine_argv=engine_argv(args), env=env,
                    gateway_argv=["--placement", args.placement])  # fmt: skip
    with Mesh(spec) as mesh:
        url = f"{mesh.url}/v1/completions"
        pids = {child.name: child.proc.pid for child in mesh.children if child.proc}

        def meshed_run(c: int, rounds: int, seed: int, output_len: int):
            """Rows, wall seconds and each service's CPU seconds a request."""
            before = cpu_seconds(pids)
            rows, wall = asyncio.run(through_mesh(url, folder.name, c, rounds, seed, output_len,
                                                  args.stagger))  # fmt: skip
            after = cpu_seconds(pids)
            return rows, wall, {n: (after[n] - before[n]) / len(rows) for n in pids}

        for k, c in enumerate(args.concurrency):  # each its own prompts: no prefix hits
            rounds = max(args.rounds, -(-args.min_requests // c))  # enough for percentiles
            alone, alone_cpu = asyncio.run(engine_alone(folder, options, c, rounds, 10 + k,
                                                        args.output_len, args.stagger))  # fmt: skip
            meshed, wall, per_request = meshed_run(c, rounds, 10 + k, args.output_len)
            a, m = summary(alone), summary(meshed)
            row = {"concurrency": c, "rounds": rounds, "engine": a, "mesh": m,
                   "added_ttft_p50_ms": m["ttft_p50_ms"] - a["ttft_p50_ms"],
                   "added_ttft_p99_ms": m["ttft_p99_ms"] - a["ttft_p99_ms"],
                   "added_tpot_p50_us": (m["tpot_p50_ms"] - a["tpot_p50_ms"]) * 1e3,
                   "cores": {n: per_request[n] * len(meshed) / wall for n in pids},
                   # each service's CPU time over the tokens it streamed
                   "cpu_us_per_token": {n: cpu / args.output_len * 1e6
                                        for n, cpu in per_request.items()}}  # fmt: skip
            if args.long_output_len:
                long_alone = asyncio.run(
                    engine_alone(
                        folder, options, c, rounds, 50 + k, args.long_output_len, args.stagger
                    )
                )[1]
                long_mesh = meshed_run(c, rounds, 50 + k, args.long_output_len)[2]
                row.update(per_token_split(per_request | {"engine alone": alone_cpu},
                                           args.output_len,
                                           long_mesh | {"engine alone": long_alone},
                                           args.long_output_len))  # fmt: skip
                slope = row["cpu_us_per_extra_token"]
                # what the mesh's processes spend a further token beyond the engine alone
                row["mesh_added_us_per_extra_token"] = (
                    sum(v for n, v in slope.items() if n in pids) - slope["engine alone"]
                )
            results["by_concurrency"].append(row)
            print(json.dumps(row), flush=True)
    if traces is not None:  # where a request's time goes, service by service (medians)
        time.sleep(1.0)  # the services' last span batches
        results["stages"] = stages(traces.snapshot())
        traces.stop()
        for name, row in results["stages"].items():
            print(f"  {name:48} +{row['start_ms']:7.2f} ms  {row['ms']:7.2f} ms  ({row['n']})")
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,64,512")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--token-us", type=float, default=20.0)
    parser.add_argument("--traces", action="store_true", help="the services export their "
                        "spans (which slows them); the result adds each stage's median start "
                        "and length")  # fmt: skip
    parser.add_argument(
        "--no-worker-links",
        dest="worker_links",
        action="store_false",
        help="the gateway makes one Generate call a request (no link a worker)",
    )
    parser.add_argument("--placement", default="auto", choices=("auto", "gateway", "scheduler"),
                        help="the gateway's --placement (auto: the gateway places, as under "
                        "`yinian up`)")  # fmt: skip
    parser.add_argument("--stagger", type=float, default=0.0,
                        help="seconds over which the clients' first requests are spread "
                        "(0: all at once, so each round's requests arrive together)")  # fmt: skip
    parser.add_argument("--output-len", type=int, default=32, help="tokens a request")
    parser.add_argument("--long-output-len", type=int, default=0,
                        help="also run each concurrency through the mesh with this many "
                        "tokens a request: the CPU a further token, apart from a "
                        "request's")  # fmt: skip
    parser.add_argument("--min-requests", type=int, default=32,
                        help="requests at each concurrency at least (more rounds)")  # fmt: skip
    parser.add_argument("--floor-calls", type=int, default=300,
                        help="gRPC round trips timed for the floor, busy and idle")  # fmt: skip
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.long_output_len and args.long_output_len <= args.output_len:
        parser.error("--long-output-len must be more than --output-len")
    with tempfile.TemporaryDirectory() as tmp:
        results = run(args, tiny_model(Path(tmp) / "tiny-llama"))
    print_table(results)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return results


def print_table(results: dict) -> None:
    print(
        "| streams | TTFT p50 engine / mesh ms | TTFT p99 engine / mesh ms | TPOT p50 engine / "
        "mesh ms | gateway, scheduler, worker cores | gateway, worker CPU µs a token |"
    )
    print("|---|---|---|---|---|---|")
    for r in results["by_concurrency"]:
        e, m, cores, us = r["engine"], r["mesh"], r["cores"], r.get("cpu_us_per_token", {})
        print(f"| {r['concurrency']} | {e['ttft_p50_ms']:.2f} / {m['ttft_p50_ms']:.2f} | "
              f"{e['ttft_p99_ms']:.2f} / {m['ttft_p99_ms']:.2f} | {e['tpot_p50_ms']:.3f} / "
              f"{m['tpot_p50_ms']:.3f} | {cores.get('gateway', 0):.2f}, "
              f"{cores.get('scheduler', 0):.2f}, {cores.get('worker-0', 0):.2f} | "
              f"{us.get('gateway', 0):.0f}, {us.get('worker-0', 0):.0f} |")  # fmt: skip
    split = [r for r in results["by_concurrency"] if "cpu_us_per_extra_token" in r]
    if split:
        print(f"\nOver {results['output_len']} and {results['long_output_len']} tokens a request:")
        print(
            "| streams | gateway, worker, engine alone CPU µs a further token "
            "| the mesh's beyond the engine's | gateway, worker CPU ms a request |"
        )
        print("|---|---|---|---|")
    for r in split:
        us, ms = r["cpu_us_per_extra_token"], r["cpu_ms_per_request_fixed"]
        print(f"| {r['concurrency']} | {us.get('gateway', 0):.0f}, {us.get('worker-0', 0):.0f}, "
              f"{us.get('engine alone', 0):.0f} | {r['mesh_added_us_per_extra_token']:.0f} | "
              f"{ms.get('gateway', 0):.2f}, {ms.get('worker-0', 0):.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
