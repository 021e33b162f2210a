"""`yinian sim`: replays a Mooncake-format trace (or a synthetic one) on
simulated workers placed by the scheduler's own code, for each worker count
and placement asked, and writes what it saw (JSON and plots).

    yinian sim --workers 10,1000 --synthetic-per-worker 100 --rate-per-worker 1 \\
        --placement kv,round-robin --out sim-out
    yinian sim --trace trace.jsonl --workers 16 --out sim-out
"""

from __future__ import annotations

import json
import platform
from dataclasses import replace
from pathlib import Path

from basis.flags import DefaultsFormatter
from basis.model_config import ModelConfig
from bench.loadgen.traces import BLOCK_TOKENS, make_trace, read_trace
from engine.presets import preset_config
from engine.step_time_model import DeviceProfile, ModelCosts, StepTimeModel, profile_names
from services.common.placement import PlacementPolicy
from yinian.sim.cluster import PLACEMENTS, Cluster, SimConfig
from yinian.sim.report import latencies, plot, summary
from yinian.sim.worker import entries_of, sim_requests


def capacity_blocks(costs: ModelCosts, kv_gib: float, block_tokens: int) -> int:
    return max(1, int(kv_gib * 2**30 / (costs.kv_bytes_per_token * block_tokens)))


def _counts(text: str, what: str) -> list:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            f"{what} must be a comma-separated list of integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise ValueError(f"{what} must be integers >= 1, got {text!r}")
    return values


def setup(args) -> tuple[SimConfig, StepTimeModel]:
    """One worker's settings as the flags give them, and the device model."""
    if args.kv_gib <= 0:
        raise ValueError("--kv-gib must be > 0")
    if args.placement_request_tokens < 0 or args.placement_memory_tokens < 0:
        raise ValueError("--placement-request-tokens and --placement-memory-tokens must be >= 0")
    costs = ModelCosts.of(ModelConfig.from_dict(preset_config(args.preset)))
    profile = DeviceProfile.load(args.device)
    config = SimConfig(
        workers=1, capacity_blocks=capacity_blocks(costs, args.kv_gib, BLOCK_TOKENS),
        block_tokens=BLOCK_TOKENS, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, service_ms=profile.service_ms,
        policy=PlacementPolicy(request_tokens=args.placement_request_tokens,
                               memory_tokens=args.placement_memory_tokens),
        placement_ms=args.placement_ms,
    )  # fmt: skip
    return config, StepTimeModel(costs, profile)


def run(args) -> dict:
    workers = _counts(args.workers, "--workers")
    placements = [p.strip() for p in args.placement.split(",") if p.strip()]
    bad = [p for p in placements if p not in PLACEMENTS]
    if bad or not placements:
        raise ValueError(f"--placement takes {', '.join(PLACEMENTS)}; got {args.placement!r}")
    if args.planner_rate is not None:
        return _plan(args)
    if (args.trace is None) == (args.synthetic_per_worker is None):
        raise ValueError("give either --trace or --synthetic-per-worker (or --planner-rate)")
    if args.rate_per_worker <= 0 or args.time_scale <= 0:
        raise ValueError("--rate-per-worker and --time-scale must be > 0")
    base, model = setup(args)
    trace = read_trace(args.trace, args.limit) if args.trace else None
    out = {"command": "yinian sim", "device": model.profile.name, "preset": args.preset,
           "placement_request_tokens": args.placement_request_tokens,
           "placement_memory_tokens": args.placement_memory_tokens,
           "python": platform.python_version(), "trace": str(args.trace) if args.trace else
           f"synthetic: {args.synthetic_per_worker} requests and {args.rate_per_worker} "
           f"conversations/s per worker, seed {args.seed}",
           "runs": []}  # fmt: skip
    series = {}
    for n in workers:
        entries = trace
        if entries is None:  # synthetic: the load grows with the workers
            count, rate = args.synthetic_per_worker * n, args.rate_per_worker * n
            entries = entries_of(make_trace(count, rate, seed=args.seed))
        for placement in placements:
            requests = sim_requests(entries, -entries[0].timestamp_ms)
            for r in requests:
                r.arrival *= args.time_scale
            config = replace(base, workers=n, placement=placement)
            result = Cluster(config, model).run(requests)
            row = {"placement": placement, **summary(result)}
            out["runs"].append(row)
            series[f"{n} workers, {placement}"] = latencies(result)
            print(_line(row), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sim.json").write_text(json.dumps(out, indent=2) + "\n")
        if not args.no_plots:
            out["plots"] = [p.name for p in plot(series, args.out)]
            (args.out / "sim.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


def _plan(args) -> dict:
    from yinian.sim import plan_run

    if args.trace is not None or args.synthetic_per_worker is not None:
        raise ValueError("--planner-rate makes its own trace: no --trace or --synthetic-per-worker")
    if min(args.planner_rate, args.plan_interval, args.ttft_slo_ms, args.itl_slo_ms) <= 0:
        raise ValueError("--planner-rate, --plan-interval and the SLOs must be > 0")
    if args.worker_start_s < 0 or not 0 < args.headroom <= 1 or args.max_workers < 1:
        raise ValueError("--worker-start-s must be >= 0, --headroom in (0, 1], "
                         "--max-workers >= 1")  # fmt: skip
    return plan_run.run(args, *setup(args))


def _line(row: dict) -> str:
    t, p, pl = row["ttft_ms"], row["tpot_ms"], row["placement_us"]
    return (f"{row['workers']:>5} workers {row['placement']:>11}: "
            f"{row['requests_finished']} done, {row['requests_refused']} refused; "
            f"TTFT p50 {t['p50']:.1f} p99 {t['p99']:.1f} ms; TPOT p50 {p['p50']:.2f} "
            f"p99 {p['p99']:.2f} ms; hit {row['kv_hit_rate']:.3f}; "
            f"{row['arrivals_tok_s_per_worker']:.0f} tok/s a worker; scheduler busy "
            f"{row['scheduler_busy']:.2f}; placement p50 "
            f"{pl['p50']:.0f} p99 {pl['p99']:.0f} µs; "
            f"{row['wall_seconds']:.1f} s wall")  # fmt: skip


def add_sim_parser(sub) -> None:
    p = sub.add_parser("sim", help="simulate a mesh of many workers on a trace",
                       description=__doc__, formatter_class=DefaultsFormatter)  # fmt: skip
    p.add_argument("--trace", type=Path, help="a Mooncake-format trace (JSONL)")
    p.add_argument("--limit", type=int, help="the trace's first N entries only")
    p.add_argument("--synthetic-per-worker", type=int,
                   help="instead of a trace: this many synthetic requests per worker")  # fmt: skip
    p.add_argument("--rate-per-worker", type=float, default=1.0,
                   help="synthetic conversations a second, per worker")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="the synthetic trace's seed")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="stretch (>1) or squeeze (<1) the arrivals")  # fmt: skip
    p.add_argument("--workers", default="16", help="worker counts, comma-separated")
    p.add_argument("--placement", default="kv", help="placements to compare, "
                   f"comma-separated: {', '.join(PLACEMENTS)}")  # fmt: skip
    defaults = PlacementPolicy()
    p.add_argument("--placement-request-tokens", type=float, default=defaults.request_tokens,
                   help="the scheduler's flag of that name: prompt tokens to compute that "
                   "weigh as much as one more request on a worker")  # fmt: skip
    p.add_argument("--placement-memory-tokens", type=float, default=defaults.memory_tokens,
                   help="the scheduler's flag of that name: what a full device pool "
                   "weighs, in prompt tokens")  # fmt: skip
    p.add_argument("--placement-ms", type=float,
                   help="each placement takes this long on the simulation's clock, not its "
                   "measured wall time: a run that repeats exactly")  # fmt: skip
    p.add_argument("--device", default="h200", choices=profile_names(),
                   help="the fitted device profile (engine/device_profiles)")  # fmt: skip
    p.add_argument("--preset", default="llama3-8b", help="the model whose steps are timed")
    p.add_argument("--kv-gib", type=float, default=91.0, help="each worker's KV pool, "
                   "GiB (an H200 with llama3-8b holds ~91)")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="each worker's sequences in one batch at most")  # fmt: skip
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="each worker's tokens in one step at most")  # fmt: skip
    p.add_argument("--planner-rate", type=float, help="instead: the SLA planner on a trace "
                   "of this many conversations a second that triples and falls again, "
                   "against an oracle that knows the trace")  # fmt: skip
    p.add_argument("--plan-interval", type=float, default=30.0,
                   help="seconds between the planner's decisions")  # fmt: skip
    p.add_argument("--ttft-slo-ms", type=float, default=500.0, help="the planner's TTFT p99 SLO")
    p.add_argument("--itl-slo-ms", type=float, default=50.0, help="the planner's ITL p99 SLO")
    p.add_argument("--worker-start-s", type=float, default=45.0,
                   help="seconds a new worker takes to serve")  # fmt: skip
    p.add_argument("--headroom", type=float, default=0.7,
                   help="the share of each SLO the planner aims at")  # fmt: skip
    p.add_argument("--max-workers", type=int, default=200, help="the planner's GPU budget")
    p.add_argument("--out", type=Path, help="a folder for sim.json and the plots")
    p.add_argument("--no-plots", action="store_true", help="write sim.json only")
    p.set_defaults(func=lambda args: 0 if run(args) else 1)
