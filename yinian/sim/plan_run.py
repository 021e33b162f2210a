"""`yinian sim --planner`: the SLA planner on a trace whose rate triples and
falls again, against the oracle that knows the trace; JSON and a plot of the
workers each chose over time."""

from __future__ import annotations

import json
from pathlib import Path

from services.scheduler.planner import CapacityProfile, PlannerConfig, SlaPlanner
from yinian.sim.cluster import SimConfig
from yinian.sim.planning import (
    interval_rates,
    phased_trace,
    profile_worker,
    run_oracle,
    run_planned,
)
from yinian.sim.report import pyplot, save

PROFILE_RATES = (1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 24, 28, 32, 36, 40, 48, 56)


def triple_and_fall(hold: float = 300.0, ramp: float = 240.0, steps: int = 12):
    """(factor, seconds) phases: 1 for `hold`, up to 3 over `ramp` in `steps`, 3 for
    `hold`, back down to 1 the same way, 1 for `hold`."""
    up = [1 + 2 * k / steps for k in range(1, steps)]
    step = ramp / steps
    return ([(1.0, hold)] + [(f, step) for f in up] + [(3.0, hold)]
            + [(f, step) for f in reversed(up)] + [(1.0, hold)])  # fmt: skip


def _run_row(result) -> dict:
    return {"gpu_seconds": result.gpu_seconds, "ttft_p99_ms": result.ttft_p99_ms,
            "itl_p99_ms": result.itl_p99_ms, "refused": result.refused}  # fmt: skip


def evaluate(args, config: SimConfig, model) -> dict:
    profile = profile_worker(config, model, list(PROFILE_RATES))
    planner_config = PlannerConfig(
        interval=args.plan_interval, ttft_slo_ms=args.ttft_slo_ms, itl_slo_ms=args.itl_slo_ms,
        max_workers=args.max_workers, horizon=1 + args.worker_start_s / args.plan_interval,
        headroom=args.headroom,
    )  # fmt: skip
    requests = phased_trace(args.planner_rate, triple_and_fall(), seed=args.seed)
    planned = run_planned(config, model, SlaPlanner(planner_config, profile), requests,
                          args.worker_start_s)  # fmt: skip
    factor, oracle = run_oracle(config, model, planner_config, profile, requests,
                                args.worker_start_s)  # fmt: skip
    out = {
        "requests": len(requests),
        "planner_config": planner_config.__dict__,
        "worker_start_s": args.worker_start_s,
        "profile": _profile_json(profile),
        "planner": _run_row(planned) | {"within_slos": planned.within(planner_config)},
        "oracle": {
            **_run_row(oracle),
            "within_slos": oracle.within(planner_config),
            "correction": factor,
        },  # fmt: skip
        "gpu_time_over_oracle": planned.gpu_seconds / oracle.gpu_seconds,
        "interval_rates": interval_rates(requests, args.plan_interval),
        "planner_log": planned.log,
        "oracle_log": oracle.log,
    }
    p, o = out["planner"], out["oracle"]
    print(f"planner: GPU {p['gpu_seconds'] / 3600:.2f} h, TTFT p99 {p['ttft_p99_ms']:.0f} ms, "
          f"ITL p99 {p['itl_p99_ms']:.1f} ms, {p['refused']} refused, within the SLOs: "
          f"{p['within_slos']}; oracle (correction {factor}): GPU {o['gpu_seconds'] / 3600:.2f} "
          f"h, TTFT p99 {o['ttft_p99_ms']:.0f} ms, ITL p99 {o['itl_p99_ms']:.1f} ms; planner "
          f"GPU time over the oracle's {out['gpu_time_over_oracle']:.3f}", flush=True)  # fmt: skip
    return out


def _profile_json(profile: CapacityProfile) -> list[dict]:
    return [{"rate": r, "ttft_p99_ms": t, "itl_p99_ms": i}
            for r, t, i in zip(profile.rates, profile.ttft_p99_ms, profile.itl_p99_ms)]  # fmt: skip


def plot(out: dict, folder: Path) -> Path:
    fig, (top, bottom) = pyplot().subplots(2, 1, figsize=(8, 6), sharex=True)
    interval = out["planner_config"]["interval"]
    rates = out["interval_rates"]
    top.step([k * interval for k in range(len(rates))], rates, where="post", color="gray")
    top.set_ylabel("requests/s")
    for name in ("planner", "oracle"):
        log = out[f"{name}_log"]
        bottom.step([r["t"] for r in log], [r["target"] for r in log], where="post", label=name)
    bottom.set_ylabel("workers asked for")
    bottom.set_xlabel("seconds (simulated)")
    bottom.legend()
    return save(fig, folder / "sim_planner.png")


def run(args, config: SimConfig, model) -> dict:
    out = evaluate(args, config, model)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        if not args.no_plots:
            out["plots"] = [plot(out, args.out).name]
        (args.out / "sim_planner.json").write_text(json.dumps(out, indent=2) + "\n")
    return out
