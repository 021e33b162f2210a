"""The engine alone (llama3-8b, bf16, dummy weights, the worker's defaults: 256
sequences, 8,192 tokens a step) on 1024->128 requests, against the roofline bound of
that workload: its FLOPs over the bf16 matmul ceiling measured in this run, or the
weights' reads of its fewest decode steps over the copy ceiling, whichever is longer.

Sections:
- `ceilings`, `model` (FLOPs a request, the bound in output tok/s);
- `offline`: 320 requests at once, output tok/s and its ratio to the bound;
- `rate_<r>`: Poisson arrivals at r req/s into `LLMEngine.step` (the engine thread's
  loop without the mesh): TTFT / TPOT percentiles from the engine's own outputs, the
  steps' make-up (prompt tokens, decoding sequences, wall time) and the engine's
  step timing (host, wait, device);
- `profile`: 64 requests at once under torch.profiler: each kernel family's time and
  the matrix products' achieved TFLOP/s (the body's FLOPs over their kernels' time).

Usage: python -m bench.gpu.saturation --out bench/results/saturation.json
           [--budget TOKENS] [--rates R ...] [--skip offline profile ...]
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict

from torch.profiler import ProfilerActivity, profile

from bench.gpu.ceilings import measure
from bench.gpu.decode_profile import family, kernel_times
from bench.gpu.engine_rates import abort_all, offline_throughput, random_prompts, sync
from bench.gpu.models import preset_folder
from bench.gpu.sections import Sections, script_parser
from engine import LLM, SamplingParams

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


def bound(config, flops: dict, ceilings: dict, output_len: int, max_seqs: int) -> dict:
    """Output tok/s the device could reach on this workload, per request amortised."""
    total = flops["body"] + flops["head"] + flops["attention"]
    compute_s = total / (ceilings["matmul_bf16_tflops"] * 1e12)
    # every decode step reads the weights once; a full batch shares a step
    weights = (config.active_parameters() + config.vocab_size * config.hidden_size) * 2
    memory_s = output_len * weights / (ceilings["copy_gbps"] * 1e9) / max_seqs
    per_request = max(compute_s, memory_s)
    return {"flops_per_request": total, "compute_s_per_request": compute_s,
            "memory_s_per_request": memory_s, "bound_requests_per_s": 1 / per_request,
            "bound_output_tokens_per_s": output_len / per_request}  # fmt: skip


class StepLog:
    """The make-up of each scheduled batch: prompt tokens, decoding sequences."""

    def __init__(self, engine):
        self.steps: list[tuple[float, int, int]] = []
        self.gaps: set[int] = set()  # steps scheduled after the engine sat idle
        scheduler, plain = engine.scheduler, engine.scheduler.schedule

        def schedule():
            batch = plain()
            prompt = sum(n for n in batch.num_new_tokens if n > 1)
            decoding = sum(1 for n in batch.num_new_tokens if n == 1)
            self.steps.append((time.perf_counter(), prompt, decoding))
            return batch

        scheduler.schedule = schedule
        self._undo = lambda: delattr(scheduler, "schedule")

    def close(self) -> None:
        self._undo()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def poisson_run(llm: LLM, rate: float, n: int, input_len: int, output_len: int) -> dict:
    """n requests arriving at `rate` (Poisson, seeded) into the engine's step loop."""
    engine = llm.engine
    rng = random.Random(int(rate * 1000))
    gaps = [rng.expovariate(rate) for _ in range(n)]
    arrivals = [sum(gaps[: i + 1]) for i in range(n)]
    prompts = random_prompts(n, input_len, engine.model_config.vocab_size, seed=int(rate))
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    before = engine.get_stats()
    log = StepLog(engine)
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    nxt, t0 = 0, time.perf_counter()
    try:
        while len(done) < n:
            now = time.perf_counter() - t0
            while nxt < n and arrivals[nxt] <= now:
                engine.add_request(str(nxt), prompts[nxt], params)
                nxt += 1
            if not engine.has_work():
                time.sleep(max(0.0, arrivals[nxt] - now))
                log.gaps.add(len(log.steps))  # the next step's wall would count the sleep
                continue
            outs = engine.step()
            t = time.perf_counter() - t0
            for out in outs:
                i = int(out.request_id)
                if i not in first and out.outputs[0].token_ids:
                    first[i] = t
                if out.finished:
                    done[i] = t
    finally:
        log.close()
    sync(llm)
    elapsed = time.perf_counter() - t0
    after = engine.get_stats()
    ttft = [(first[i] - arrivals[i]) * 1e3 for i in range(n)]
    tpot = [(done[i] - first[i]) / (output_len - 1) * 1e3 for i in range(n)]
    # each step's wall: until the next was scheduled (none across an idle sleep)
    timed_steps = [(b[0] - a[0], a) for i, (a, b) in enumerate(zip(log.steps, log.steps[1:]))
                   if i + 1 not in log.gaps]  # fmt: skip
    walls = [w for w, _ in timed_steps]
    prompt_steps = [w for w, s in timed_steps if s[1] > 0]
    steps = after["num_steps"] - before["num_steps"]
    timed = after["steps_device_timed"] - before["steps_device_timed"]
    out = {
        "rate": rate, "requests": n, "elapsed_s": elapsed,
        "output_tokens_per_s": n * output_len / elapsed,
        "ttft_ms": {q: percentile(ttft, q) for q in (50, 90, 99)},
        "tpot_ms": {q: percentile(tpot, q) for q in (50, 90, 99)},
        "steps": len(log.steps),
        "prompt_tokens_per_prompt_step": sum(s[1] for s in log.steps if s[1])
        / max(1, sum(1 for s in log.steps if s[1])),
        "decoding_per_step": sum(s[2] for s in log.steps) / max(1, len(log.steps)),
        "wall_ms_per_step": sum(walls) / max(1, len(walls)) * 1e3,
        "wall_ms_per_prompt_step": sum(prompt_steps) / max(1, len(prompt_steps)) * 1e3,
        "wall_ms_per_decode_step": (sum(walls) - sum(prompt_steps))
        / max(1, len(walls) - len(prompt_steps)) * 1e3,
        "wait_ms_per_step": (after["step_wait_seconds"] - before["step_wait_seconds"])
        / max(1, steps) * 1e3,
        "device_ms_per_timed_step": (after["step_device_seconds"] - before["step_device_seconds"])
        / max(1, timed) * 1e3,
    }  # fmt: skip
    out["within_slo"] = out["ttft_ms"][99] <= 200 and out["tpot_ms"][99] <= 50
    return out


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
    families: dict[str, float] = defaultdict(float)
    for name, (ms, _) in by_name.items():
        families[family(name)] += ms
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
    args = parser.parse_args(argv)
    preset, inp, outp, offline_n, rates, rate_n, prof_n = GPU if args.device == "cuda" else DRY
    rates = args.rates or rates
    with Sections(args, script="saturation", preset=preset, budget=args.budget) as section:
        ceilings = section("ceilings", lambda: measure(section.device))

        def make() -> LLM:
            folder, load_format = preset_folder(section.tmp, preset)
            return LLM(folder, dtype="bfloat16" if section.cuda else "float32",
                       device=section.device, load_format=load_format,
                       kernels="auto" if section.cuda else "torch", max_num_seqs=256,
                       max_num_batched_tokens=args.budget, max_model_len=4096)  # fmt: skip

        llm = section.resource(make, LLM.close)

        def model() -> dict:
            config = llm().engine.model_config
            flops = request_flops(config, inp, outp)
            return {"input_len": inp, "output_len": outp, "flops": flops,
                    **bound(config, flops, ceilings, outp, 256)}  # fmt: skip

        m = section("model", model)

        def offline() -> dict:
            r = offline_throughput(llm(), offline_n, inp, outp)
            r["of_bound"] = r["output_tokens_per_s"] / m["bound_output_tokens_per_s"]
            return r

        section("offline", offline)
        for rate in rates:

            def at_rate(rate=rate) -> dict:
                r = poisson_run(llm(), rate, rate_n, inp, outp)
                abort_all(llm())
                return r

            section(f"rate_{rate:g}", at_rate)
        section("profile", lambda: profiled_run(llm(), prof_n, inp, outp, m["flops"]))
        print_summary(section.results)
        return section.results


def print_summary(results: dict) -> None:
    m, off = results.get("model", {}), results.get("offline", {})
    if "bound_output_tokens_per_s" in m:
        print(f"bound {m['bound_output_tokens_per_s']:.0f} out tok/s "
              f"({m['bound_requests_per_s']:.1f} req/s)")  # fmt: skip
    if "output_tokens_per_s" in off:
        print(f"offline {off['output_tokens_per_s']:.0f} out tok/s, {off['of_bound']:.2f} of bound")
    for name, r in results.items():
        if name.startswith("rate_") and "ttft_ms" in r:
            print(f"{name}: {r['output_tokens_per_s']:.0f} out tok/s, TTFT p50/p99 "
                  f"{r['ttft_ms'][50]:.0f}/{r['ttft_ms'][99]:.0f} ms, TPOT p99 "
                  f"{r['tpot_ms'][99]:.1f} ms, within SLO {r['within_slo']}; step "
                  f"{r['wall_ms_per_step']:.1f} ms (prompt {r['wall_ms_per_prompt_step']:.1f}, "
                  f"decode {r['wall_ms_per_decode_step']:.1f}), "
                  f"{r['prompt_tokens_per_prompt_step']:.0f} prompt tokens a prompt step, "
                  f"{r['decoding_per_step']:.0f} decoding, device "
                  f"{r['device_ms_per_timed_step']:.1f} ms, "
                  f"wait {r['wait_ms_per_step']:.1f}")  # fmt: skip
    p = results.get("profile", {})
    if "families_s" in p:
        fams = ", ".join(f"{f} {s:.2f}" for f, s in p["families_s"].items())
        print(f"profile: wall {p['wall_s']:.2f} s, kernels {p['kernel_s']:.2f} s ({fams}); "
              f"matmul {p['matmul_tflops'] or 0:.0f} TFLOP/s")  # fmt: skip


if __name__ == "__main__":
    main()
