"""Whether a step is bound by the host queueing it or by the device running it:
llama3-8b (bf16, dummy weights, the worker's defaults) steps of a chosen make-up
(sequences decoding at about 1k context beside prompt tokens), each launched twice:

- held: the device kept busy (torch.cuda._sleep) while the host queues the step, so
  the events around it time the device's work alone, without gaps;
- free: the device idle when the launch begins, as after a short step: the events
  then time the step as it runs when the host feeds it kernel by kernel.

Per make-up: the host's time in `ModelRunner.launch` (queueing the forward pass and
the sampling) and the device's held and free times. Where the launch takes about as
long as the free time and the held time is shorter, the step waits on the host.
`ops`: the host's microseconds a call of the layers' operators (kernels.ops).

Usage: python -m bench.gpu.launch_cost --out bench/results/launch_cost.json
           [--engine-flags="--piece-graphs ..."]
"""

from __future__ import annotations

import time

import torch

from bench.gpu.engine_rates import abort_all, random_prompts, start_decode, sync, worker_llm
from bench.gpu.sections import Sections, script_parser
from engine import LLM, SamplingParams
from engine.cli_args import options_from_flags
from kernels.selection import SLEEP_CYCLES_PER_S

# preset, context, (decoding, prompt tokens) per make-up, repeats
GPU = ("llama3-8b", 1024, ((80, 0), (80, 1024), (80, 2048), (0, 2048), (0, 8192)), 2)
DRY = ("tiny-llama", 16, ((3, 0), (3, 8), (0, 16)), 1)


def timed_launch(llm: LLM, held: bool) -> dict:
    """The next step's launch, timed on the host and (on CUDA) on the device."""
    engine, cuda = llm.engine, llm.engine.facts.device.type == "cuda"
    runner, plain = engine.runner, engine.runner.launch
    out: dict = {}

    def launch(*args, **kwargs):
        sync(llm)
        if cuda and held:
            torch.cuda._sleep(int(0.5 * SLEEP_CYCLES_PER_S))  # 0.5 s: longer than any launch
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        if start is not None:
            start.record()
        began = time.perf_counter()
        result = plain(*args, **kwargs)
        out["host_ms"] = (time.perf_counter() - began) * 1e3
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            out["device_ms"] = start.elapsed_time(end)
        return result

    runner.launch = launch
    try:
        engine.step()
    finally:
        del runner.launch
    return out


def make_up(llm: LLM, decoding: int, prompt: int, context: int, repeats: int) -> dict:
    rows = []
    for r in range(repeats + 1):  # the first round warms this make-up's shapes up: left out
        for held in (True, False):
            if decoding:
                start_decode(llm, decoding, context, 16)
            engine = llm.engine
            each = min(prompt, 2048)  # prompts of 2k tokens at most
            vocab = engine.model_config.vocab_size
            # a seed of its own each time: no prefix of these prompts is cached
            seed = 10_000 + 100 * prompt + 1000 * decoding + 10 * r + held
            for i, ids in enumerate(random_prompts(prompt // each if prompt else 0, each, vocab,
                                                   seed=seed)):  # fmt: skip
                engine.add_request(f"prompt-{r}-{held}-{i}", ids,
                                   SamplingParams(max_tokens=2, ignore_eos=True))  # fmt: skip
            # async scheduling: the step launched now is read back in the next call
            engine.async_scheduling = False
            try:
                timed = timed_launch(llm, held)
                if r:
                    rows.append({"held": held, **timed})
            finally:
                engine.async_scheduling = True
                abort_all(llm)
                sync(llm)

    def mean(held: bool, key: str):
        values = [row[key] for row in rows if row["held"] == held and key in row]
        return sum(values) / len(values) if values else None

    return {"decoding": decoding, "prompt_tokens": prompt,
            "host_ms": mean(False, "host_ms"), "held_device_ms": mean(True, "device_ms"),
            "free_device_ms": mean(False, "device_ms"), "runs": rows}  # fmt: skip


def host_us(fn, cuda: bool, calls: int = 200) -> float:
    """Host microseconds a call of fn takes to queue (the device held busy meanwhile)."""
    fn()
    sync_cuda = torch.cuda.synchronize if cuda else (lambda: None)
    sync_cuda()
    if cuda:
        torch.cuda._sleep(int(0.5 * SLEEP_CYCLES_PER_S))
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    took = time.perf_counter() - began
    sync_cuda()
    return took / calls * 1e6


def op_costs(llm: LLM, rows: int) -> dict:
    """Host us a call of the layers' operators at `rows` tokens: through `kernels.ops`
    (the kernel Selector's choice, then its launch), the chosen launch called directly,
    and torch's own matrix product for comparison."""
    from kernels import norm, ops

    engine = llm.engine
    cuda, device = engine.facts.device.type == "cuda", engine.facts.device
    h = engine.model_config.hidden_size
    dtype = torch.bfloat16 if cuda else torch.float32
    x = torch.randn(rows, h, device=device, dtype=dtype)
    w = torch.ones(h, device=device, dtype=dtype)
    gate_up = torch.randn(rows, 2 * h, device=device, dtype=dtype)
    proj = torch.randn(h, h, device=device, dtype=dtype)
    chosen = norm._rms_norm_selector.choose(x, w, 1e-5)
    launch = norm._rms_norm_selector.variants[chosen.variant]
    with ops.using("auto"):
        return {"rows": rows,
                "rms_norm_us": host_us(lambda: ops.rms_norm(x, w, 1e-5), cuda),
                "rms_norm_direct_us": host_us(lambda: launch(x, w, 1e-5, **chosen.kwargs), cuda),
                "silu_and_mul_us": host_us(lambda: ops.silu_and_mul(gate_up), cuda),
                "linear_us": host_us(lambda: ops.linear(x, proj), cuda),
                "torch_mm_us": host_us(lambda: x @ proj.t(), cuda)}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--engine-flags", default="", help="more engine options, one string "
                        "(--engine-flags=--piece-graphs)")  # fmt: skip
    args = parser.parse_args(argv)
    extra = options_from_flags(args.engine_flags.split())
    preset, context, make_ups, repeats = GPU if args.device == "cuda" else DRY
    with Sections(args, script="launch_cost", preset=preset,
                  engine_flags=args.engine_flags) as section:  # fmt: skip
        llm = section.resource(lambda: worker_llm(section, preset, **extra), LLM.close)
        for decoding, prompt in make_ups:
            run = lambda d=decoding, p=prompt: make_up(llm(), d, p, context, repeats)  # noqa: E731
            section(f"d{decoding}_p{prompt}", run)
        section("ops", lambda: op_costs(llm(), 2048 if section.cuda else 16))
        for name, r in section.results.items():
            if name == "ops" and "rows" in r:
                print(", ".join(f"{k} {v:.1f}" for k, v in r.items() if k != "rows"))
            if isinstance(r, dict) and "host_ms" in r:
                held, free = r["held_device_ms"] or 0.0, r["free_device_ms"] or 0.0
                print(f"{name}: launch {r['host_ms']:.2f} ms on the host; device {held:.2f} "
                      f"held, {free:.2f} free")  # fmt: skip
        return section.results


if __name__ == "__main__":
    main()
