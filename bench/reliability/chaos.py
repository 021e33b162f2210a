"""The chaos drill: under concurrent streams, kill -9 each service of a CPU mesh
in turn, with `yinian up`'s supervisor restarting it, and record what clients saw.

The mesh: tiny-llama on the CPU; one colocated worker, one prefill and two decode
workers (every decode request prefilled remotely), the scheduler, two gateways,
NATS, Redis and the KV store. A clean round first gives each prompt's text; then
one round per service. Expert services get a mesh of their own: tiny-moe, one
colocated worker whose routed experts run on two expert services (with
redundant slots, so most experts have a replica on the other service).
Per service: streams hung (goal 0), corrupted (goal 0: every completed stream
equals the clean run), failed (goal <= 1%), and seconds from the kill until new
requests succeed again (goal < 10). Streams through a killed gateway end with
its connections; they are counted apart, as lost with it (a client retries them
on the other gateway, which the probe shows serving).

Usage: python -m bench.reliability.chaos [--streams 50] [--max-tokens 1000]
           [--targets worker-0 scheduler ...] [--expert-targets expert-0]
           [--out bench/results/chaos.json]
Writes the JSON and, beside it, the table (chaos.md).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.reliability.rounds import Fault, Load, RoundResult, run_round, write_results
from yinian.mesh import Mesh, MeshSpec
from yinian.mesh_probe import list_workers, scrape
from yinian.supervisor import Supervisor

TARGETS = ("worker-0", "prefill-0", "decode-0", "scheduler", "gateway-1", "nats", "redis",
           "kvstore")  # fmt: skip
GOALS = {"hung": 0, "corrupted": 0, "failed_fraction": 0.01, "recovery_s": 10.0}
# Prefills happen as the streams start: the prefill worker is killed then.
KILL_AFTER_S = {"prefill-0": 0.3}


EXPERT_TARGETS = ("expert-0",)


def tiny_model(folder: Path, preset: str = "tiny-llama") -> Path:
    from engine.make_model import preset_config, write_model

    if not (folder / "config.json").is_file():
        write_model(folder, preset_config(preset), seed=1)
    return folder


def expert_spec(model: Path, **overrides) -> MeshSpec:
    """One colocated worker, its routed experts on two expert services; 4 redundant
    slots per layer over tiny-moe's 8 experts."""
    values = dict(model=str(model), workers=1, experts=2, gateways=1, port=0,
                  engine_argv=["--device", "cpu"],
                  scheduler_argv=["--expert-redundant-slots", "4"])  # fmt: skip
    values.update(overrides)
    return MeshSpec(**values)


def chaos_spec(model: Path, **overrides) -> MeshSpec:
    values = dict(model=str(model), workers=1, prefill=1, decode=2, gateways=2, kvstore=True,
                  port=0, engine_argv=["--device", "cpu"],
                  scheduler_argv=["--disagg-min-tokens", "1"])  # fmt: skip
    values.update(overrides)
    return MeshSpec(**values)


def prompts(count: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(500) for _ in range(rng.randrange(20, 200))] for _ in range(count)]


def wait_settled(mesh: Mesh, name: str, workers: int, timeout: float = 90.0) -> None:
    """Until `name` runs again, is ready, and the scheduler lists every worker as
    ready (so each round starts from a whole mesh)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        child = mesh.child(name)
        if child.proc.poll() is None and child.ready.is_set():
            try:
                if sum(w.ready for w in list_workers(mesh)) == workers:
                    return
            except Exception:  # noqa: BLE001 - the scheduler itself may be starting
                pass
        time.sleep(0.1)
    raise TimeoutError(f"{name} or a worker not back {timeout:.0f} s after the kill")


def row(result: RoundResult, back_s: float | None) -> dict:
    entry = result.summary()
    entry["failed_fraction"] = len(result.failed) / max(1, result.streams)
    entry["back_s"] = back_s
    entry["goals_met"] = (
        len(result.hung) <= GOALS["hung"]
        and len(result.corrupted) <= GOALS["corrupted"]
        and entry["failed_fraction"] <= GOALS["failed_fraction"]
        and result.recovery_s is not None
        and result.recovery_s < GOALS["recovery_s"]
    )
    return entry


def drill(
    mesh: Mesh, targets, load: Load, say=print, kill_at: float = 0.3, min_probe_s: float = 10.0
) -> dict:
    """A clean round, then one kill -9 per target under the same load, once the
    gateways have streamed `kill_at` of the round's tokens, or `kill_at` of the clean
    round's duration after the streams were sent, whichever comes first (a fixed
    time alone let a round faster than the clean one end before its kill)."""
    stop = threading.Event()
    supervisor = Supervisor(mesh, say=lambda line: say(f"  supervisor: {line}"))
    watcher = threading.Thread(target=supervisor.run, args=(stop,), daemon=True)
    watcher.start()
    workers = mesh.spec.workers + mesh.spec.prefill + mesh.spec.decode
    total = len(load.prompts) * load.max_tokens  # tokens a round streams
    try:
        clean = asyncio.run(run_round(load, Fault("clean", None)))
        say(f"clean: {len(clean.failed)} failed, {len(clean.hung)} hung, {clean.seconds:.1f} s")
        out = {"clean": clean.summary(), "rounds": {}}
        if clean.failed or clean.hung:
            raise RuntimeError(f"the clean round failed: {clean.summary()}")
        for name in targets:
            killed_at = []

            def inject(name=name, killed_at=killed_at) -> None:
                killed_at.append(time.monotonic())
                mesh.kill(name)

            gateway = _gateway_index(name)
            due = None if name in KILL_AFTER_S else _progressed(mesh, kill_at * total)
            fault = Fault(name, inject, KILL_AFTER_S.get(name, kill_at * clean.seconds),
                          probe_url=mesh.urls[gateway] if gateway is not None else "",
                          lost_with=gateway, due=due)  # fmt: skip
            result = asyncio.run(run_round(load, fault, clean.texts, min_probe_s=min_probe_s))
            wait_settled(mesh, name, workers)
            # the supervisor's next look notes when it came back (after this kill)
            deadline = time.monotonic() + 2.0
            while (supervisor.back_at(name) or 0.0) < killed_at[0]:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            back_at = supervisor.back_at(name)
            out["rounds"][name] = row(result, back_at - killed_at[0] if back_at else None)
            say(format_row(name, out["rounds"][name]))
        return out
    finally:
        stop.set()
        watcher.join(timeout=5)


def _progressed(mesh: Mesh, tokens: float):
    """A Fault's `due`: true once the gateways have streamed `tokens` more tokens than
    when it was made."""

    def streamed() -> float:
        total = 0.0
        for url in mesh.urls[: mesh.spec.gateways]:
            try:
                total += scrape(f"{url}/metrics", "yinian:generation_tokens_total",
                                verify=mesh.ssl_context() or True)  # fmt: skip
            except httpx.HTTPError:  # one away (restarting): the time bound stands
                pass
        return total

    start = streamed()
    return lambda: streamed() - start >= tokens


def _gateway_index(name: str) -> int | None:
    if name == "gateway":
        return 0
    if name.startswith("gateway-"):
        return int(name.split("-")[1])
    return None


HEADER = (
    "| service killed | streams open at kill | completed = clean | corrupted | failed "
    "| lost with gateway | hung | new requests OK after (s) | back (s) | goals |"
)


def format_row(name: str, r: dict) -> str:
    recovery = "never" if r["recovery_s"] is None else f"{r['recovery_s']:.2f}"
    back = "?" if r["back_s"] is None else f"{r['back_s']:.1f}"
    return (f"| {name} | {r['open_at_fault']} | {r['completed']}/{r['streams']} "
            f"| {len(r['corrupted'])} | {len(r['failed'])} ({100 * r['failed_fraction']:.1f}%) "
            f"| {len(r['lost_with_gateway'])} | {len(r['hung'])} | {recovery} | {back} "
            f"| {'met' if r['goals_met'] else 'MISSED'} |")  # fmt: skip


def table(results: dict) -> str:
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    lines += [format_row(name, r) for name, r in results["rounds"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=50, help="concurrent streams per round")
    parser.add_argument("--max-tokens", type=int, default=1000, help="tokens per stream")
    parser.add_argument("--targets", nargs="*", default=list(TARGETS), help="services to kill")
    parser.add_argument("--expert-targets", nargs="*", default=list(EXPERT_TARGETS),
                        help="expert services to kill (in the MoE mesh)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench/results/chaos.json"))
    parser.add_argument("--logs", type=Path, help="keep the services' logs here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        results = {"rounds": {}}
        if args.targets:
            model = tiny_model(Path(tmp) / "tiny-llama")
            with Mesh(chaos_spec(model, log_dir=args.logs or Path(tmp) / "logs")) as mesh:
                load = Load(mesh.urls, "tiny-llama", prompts(args.streams), args.max_tokens)
                results = drill(mesh, args.targets, load)
        if args.expert_targets:
            model = tiny_model(Path(tmp) / "tiny-moe", "tiny-moe")
            with Mesh(expert_spec(model, log_dir=args.logs or Path(tmp) / "moe-logs")) as moe:
                load = Load(moe.urls, "tiny-moe", prompts(args.streams), args.max_tokens)
                experts = drill(moe, args.expert_targets, load)
            results["expert_clean"] = experts["clean"]
            results["rounds"].update(experts["rounds"])
    results["setup"] = {"streams": args.streams, "max_tokens": args.max_tokens,
                        "mesh": "tiny-llama on CPU: 1 colocated, 1 prefill, 2 decode workers, "
                                "scheduler, 2 gateways, NATS, Redis, KV store",
                        "expert_mesh": "tiny-moe on CPU: 1 colocated worker, 2 expert "
                                       "services (4 redundant slots), scheduler, gateway, NATS",
                        "goals": GOALS}  # fmt: skip
    write_results(args.out, results, table(results))
    return results


if __name__ == "__main__":
    main()
