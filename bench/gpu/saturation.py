"""The engine alone (llama3-8b, bf16, dummy weights, the worker's defaults: 256
sequences, 8,192 tokens a step) on 1024->128 requests, against the roofline bound of
that workload (`bound`: its FLOPs over the bf16 matmul ceiling measured in this run,
against its reads over the copy ceiling) and the serial bound (decode's KV reads added
to the compute).

Sections:
- `ceilings`, `model` (FLOPs a request, the bound in output tok/s);
- `offline`: 320 requests at once, output tok/s and its ratio to the bound;
- `rate_<r>`: Poisson arrivals at r req/s into `LLMEngine.step` (the engine thread's
  loop without the mesh): TTFT / TPOT percentiles from the engine's own outputs, and
  each kind of step's make-up and times (bench/gpu/step_record.py);
- `host_profile`: the first rate's run (half its requests) under cProfile;
- `runtime_calls`: a quarter of them under torch.profiler: the CUDA runtime calls;
- `profile`: 64 requests at once under torch.profiler: each kernel family's time and
  the matrix products' achieved TFLOP/s (the body's FLOPs over their kernels' time).

Usage: python -m bench.gpu.saturation --out bench/results/saturation.json
           [--budget TOKENS] [--rates R ...] [--skip offline profile ...]
           [--engine-flags="--piece-graphs ..."]
"""

from __future__ import annotations

import cProfile
import pstats
import random
import time
from collections import defaultdict
from itertools import accumulate
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.gpu.ceilings import measure
from bench.gpu.decode_profile import family_times, kernel_times
from bench.gpu.engine_rates import (
    abort_all,
    offline_throughput,
    random_prompts,
    sync,
    worker_llm,
)
from bench.gpu.sections import Sections, script_parser
from bench.gpu.step_record import StepRecorder
from bench.loadgen.metrics import nearest_rank
from engine import LLM, SamplingParams
from engine.cli_args import options_from_flags

# preset, input, output, offline requests, rates, requests a rate, profiled requests
GPU = ("llama3-8b", 1024, 128, 320, (24.0, 32.0), 320, 64)
DRY = ("tiny-llama", 24, 4, 6, (40.0,), 6, 3)


def request_flops(config, input_len: int, output_len: int) -> dict:
    """FLOPs of one request: every computed token through the body's matrices, the LM
    head at each sampled position, attention (QK and PV) over each token's context."""
    h = config.hidden_size
    body = config.active_parameters() - config.vocab_size * h  # the head left out
    computed = input_len + output_len - 1  # the last token is sampled, never fed back
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    attn_per_pos = 4 * config.num_hidden_layers * config.num_attention_heads * head_dim
    return {
        "body": 2 * body * computed,
        "head": 2 * config.vocab_size * h * output_len,
        "attention": attn_per_pos * computed * (computed + 1) // 2,
        "body_per_token": 2 * body,
    }


def bound(
    config,
    flops: dict,
    ceilings: dict,
    output_len: int,
    max_seqs: int,
    kv_bytes_per_token: int,
    input_len: int,
) -> dict:
    """Output tok/s the device could reach on this workload, per request amortised.
    The roofline: the longer of its FLOPs over the matmul ceiling and its bytes over
    the copy ceiling (every decode step reads the weights, shared by a full batch, and
    each decode token its context's KV). The serial bound adds the two: decode's
    attention reads the KV in kernels of its own, beside no matrix product."""
    total = flops["body"] + flops["head"] + flops["attention"]
    compute_s = total / (ceilings["matmul_bf16_tflops"] * 1e12)
    copy = ceilings["copy_gbps"] * 1e9
    weights = config.active_parameters() * 2  # the LM head in, the embedding's rows out
    weights_s = output_len * weights / copy / max_seqs
    # decode token t (1..output_len-1) reads the KV of input_len + t tokens
    contexts = sum(input_len + t for t in range(1, output_len))
    kv_s = contexts * kv_bytes_per_token / copy
    roofline = max(compute_s, weights_s + kv_s)
    serial = compute_s + kv_s
    return {"flops_per_request": total, "compute_s_per_request": compute_s,
            "weights_s_per_request": weights_s, "kv_read_s_per_request": kv_s,
            "bound_requests_per_s": 1 / roofline,
            "bound_output_tokens_per_s": output_len / roofline,
            "serial_bound_requests_per_s": 1 / serial,
            "serial_bound_output_tokens_per_s": output_len / serial}  # fmt: skip


def poisson_run(llm: LLM, rate: float, n: int, input_len: int, output_len: int) -> dict:
    """n requests arriving at `rate` (Poisson, seeded) into the engine's step loop."""
    engine = llm.engine
    rng = random.Random(int(rate * 1000))
    arrivals = list(accumulate(rng.expovariate(rate) for _ in range(n)))
    prompts = random_prompts(n, input_len, engine.model_config.vocab_size, seed=int(rate))
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    nxt, t0 = 0, time.perf_counter()
    with StepRecorder(engine) as rec:
        while len(done) < n:
            now = time.perf_counter() - t0
            while nxt < n and arrivals[nxt] <= now:
                engine.add_request(str(nxt), prompts[nxt], params)
                nxt += 1
            if not engine.has_work():
                time.sleep(max(0.0, arrivals[nxt] - now))
                continue
            outs = engine.step()
            t = time.perf_counter() - t0
            for out in outs:
                i = int(out.request_id)
                if i not in first and out.outputs[0].token_ids:
                    first[i] = t
                if out.finished:
                    done[i] = t
    sync(llm)
    elapsed = time.perf_counter() - t0
    ttft = [(first[i] - arrivals[i]) * 1e3 for i in range(n)]
    tpot = [(done[i] - first[i]) / (output_len - 1) * 1e3 for i in range(n)]
    device = sum(s.device_ms or 0.0 for s in rec.steps) / 1e3
    out = {
        "rate": rate, "requests": n, "elapsed_s": elapsed,
        "output_tokens_per_s": n * output_len / elapsed,
        "ttft_ms": {q: nearest_rank(ttft, q / 100) for q in (50, 90, 99)},
        "tpot_ms": {q: nearest_rank(tpot, q / 100) for q in (50, 90, 99)},
        "steps": len(rec.steps),
        # the device's timed share of the run (untimed steps, prompts' middle chunks, left out)
        "device_busy": device / elapsed,
        "steps_by_kind": rec.summary(),
    }  # fmt: skip
    out["within_slo"] = out["ttft_ms"][99] <= 200 and out["tpot_ms"][99] <= 50
    return out


def host_profile(llm: LLM, rate: float, n: int, input_len: int, output_len: int) -> dict:
    """The engine thread's Python time under cProfile while n requests arrive at `rate`
    (slower than without it: the shares count, not the times): the functions that
    took the most time of their own, per step."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        r = poisson_run(llm, rate, n, input_len, output_len)
    finally:
        prof.disable()
    stats = {k: v for k, v in pstats.Stats(prof).stats.items() if "sleep" not in k[2]}  # idle
    steps = max(1, r["steps"])
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:30]
    return {
        "rate": rate, "requests": n, "steps": r["steps"],
        "own_ms_per_step": sum(v[2] for v in stats.values()) / steps * 1e3,
        "top_own": [{"function": f"{Path(k[0]).name}:{k[1]}({k[2]})",
                     "calls_per_step": v[1] / steps, "own_ms_per_step": v[2] / steps * 1e3,
                     "cum_ms_per_step": v[3] / steps * 1e3}
                    for k, v in rows],
    }  # fmt: skip


def runtime_calls(llm: LLM, rate: float, n: int, input_len: int, output_len: int) -> dict:
    """The CUDA runtime calls the engine thread makes while n requests arrive at
    `rate`, under torch.profiler: each call's host time a step (a synchronize, a host
    allocation or a blocking copy in a launch stalls the device behind it)."""
    cuda = llm.engine.facts.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        r = poisson_run(llm, rate, n, input_len, output_len)
    steps = max(1, r["steps"])
    calls: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CPU and ev.name.startswith("cuda"):
            calls[ev.name][0] += ev.cpu_time_total / 1e3
            calls[ev.name][1] += 1
    top = sorted(calls.items(), key=lambda kv: -kv[1][0])[:15]
    return {"rate": rate, "requests": n, "steps": r["steps"],
            "calls": [{"name": k, "ms_per_step": ms / steps, "calls_per_step": c / steps}
                      for k, (ms, c) in top]}  # fmt: skip


def profiled_run(llm: LLM, n: int, input_len: int, output_len: int, flops: dict) -> dict:
    """n requests at once under torch.profiler: each kernel family's time and what the
    matrix products reached."""
    cuda = llm.engine.facts.device.type == "cuda"
    prompts = random_prompts(n, input_len, llm.engine.model_config.vocab_size, seed=11)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    sync(llm)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params)
        sync(llm)
    wall = time.perf_counter() - start
    by_name = kernel_times(prof, cuda)
    families = family_times(by_name)
    kernel_ms = sum(families.values())
    body = flops["body"] * n
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:20]
    return {
        "requests": n, "wall_s": wall, "kernel_s": kernel_ms / 1e3,
        "families_s": {f: ms / 1e3 for f, ms in sorted(families.items(), key=lambda kv: -kv[1])},
        "matmul_tflops": body / (families["matmul"] / 1e3) / 1e12 if families["matmul"] else None,
        "attention_tflops": flops["attention"] * n / (families["attention"] / 1e3) / 1e12
        if families["attention"] else None,
        "top_kernels": [{"name": k[:120], "s": ms / 1e3, "calls": c} for k, (ms, c) in top],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    parser.add_argument("--rates", type=float, nargs="*", help="req/s (default: 24 32)")
    parser.add_argument("--engine-flags", default="", help="more engine options, one string "
                        "(--engine-flags=--piece-graphs)")  # fmt: skip
    args = parser.parse_args(argv)
    extra = options_from_flags(args.engine_flags.split())
    preset, inp, outp, offline_n, rates, rate_n, prof_n = GPU if args.device == "cuda" else DRY
    rates = args.rates or rates
    with Sections(args, script="saturation", preset=preset, budget=args.budget,
                  engine_flags=args.engine_flags) as section:  # fmt: skip
        ceilings = section("ceilings", lambda: measure(section.device))

        def make() -> LLM:
            return worker_llm(section, preset, max_num_batched_tokens=args.budget, **extra)

        llm = section.resource(make, LLM.close)

        def model() -> dict:
            engine = llm().engine
            config, kv = engine.model_config, engine.runner.kv_spec.bytes_per_token
            flops = request_flops(config, inp, outp)
            return {"input_len": inp, "output_len": outp, "flops": flops,
                    "kv_bytes_per_token": kv,
                    **bound(config, flops, ceilings, outp, 256, kv, inp)}  # fmt: skip

        m = section("model", model)

        def offline() -> dict:
            r = offline_throughput(llm(), offline_n, inp, outp)
            r["of_bound"] = r["output_tokens_per_s"] / m["bound_output_tokens_per_s"]
            r["of_serial_bound"] = r["output_tokens_per_s"] / m["serial_bound_output_tokens_per_s"]
            return r

        section("offline", offline)
        for rate in rates:

            def at_rate(rate=rate) -> dict:
                r = poisson_run(llm(), rate, rate_n, inp, outp)
                abort_all(llm())
                return r

            section(f"rate_{rate:g}", at_rate)
        section("host_profile", lambda: host_profile(llm(), rates[0], rate_n // 2, inp, outp))
        section("runtime_calls", lambda: runtime_calls(llm(), rates[0], rate_n // 4, inp, outp))
        section("profile", lambda: profiled_run(llm(), prof_n, inp, outp, m["flops"]))
        print_summary(section.results)
        return section.results


def print_summary(results: dict) -> None:
    m, off = results.get("model", {}), results.get("offline", {})
    if "bound_output_tokens_per_s" in m:
        print(f"bound {m['bound_output_tokens_per_s']:.0f} out tok/s "
              f"({m['bound_requests_per_s']:.1f} req/s), serial bound "
              f"{m['serial_bound_output_tokens_per_s']:.0f} "
              f"({m['serial_bound_requests_per_s']:.1f} req/s)")  # fmt: skip
    if "output_tokens_per_s" in off:
        print(
            f"offline {off['output_tokens_per_s']:.0f} out tok/s, {off['of_bound']:.2f} of "
            f"bound, {off['of_serial_bound']:.2f} of the serial bound"
        )
    for name, r in results.items():
        if not (name.startswith("rate_") and "ttft_ms" in r):
            continue
        print(f"{name}: {r['output_tokens_per_s']:.0f} out tok/s, TTFT p50/p99 "
              f"{r['ttft_ms'][50]:.0f}/{r['ttft_ms'][99]:.0f} ms, TPOT p99 "
              f"{r['tpot_ms'][99]:.1f} ms, within SLO {r['within_slo']}, "
              f"{r['steps']} steps, device busy {r['device_busy']:.2f}")  # fmt: skip
        for kind, g in r["steps_by_kind"].items():
            print(f"  {kind:>15}: {g['steps']:5d} steps, {g['prompt_tokens']:6.0f} prompt tokens, "
                  f"{g['decoding']:4.0f} decoding; ms: launch {g['launch_ms']:.2f}, complete "
                  f"{g['complete_ms']:.2f}, wait {g['wait_ms']:.2f}, device "
                  f"{g['device_ms'] or 0:.2f} ({g['device_timed']} timed)")  # fmt: skip
    h = results.get("host_profile", {})
    if "top_own" in h:
        print(f"host profile at {h['rate']:g} req/s: {h['own_ms_per_step']:.2f} ms a step")
        for row in h["top_own"][:20]:
            print(f"  {row['own_ms_per_step']:7.3f} own {row['cum_ms_per_step']:7.3f} cum "
                  f"{row['calls_per_step']:7.1f} calls  {row['function']}")  # fmt: skip
    for row in results.get("runtime_calls", {}).get("calls", [])[:10]:
        print(f"  {row['ms_per_step']:7.3f} ms {row['calls_per_step']:7.1f} calls a step  "
              f"{row['name']}")  # fmt: skip
    p = results.get("profile", {})
    if "families_s" in p:
        fams = ", ".join(f"{f} {s:.2f}" for f, s in p["families_s"].items())
        print(f"profile: wall {p['wall_s']:.2f} s, kernels {p['kernel_s']:.2f} s ({fams}); "
              f"matmul {p['matmul_tflops'] or 0:.0f} TFLOP/s")  # fmt: skip


if __name__ == "__main__":
    main()
