"""When does a step with a short prompt chunk pay to run in the decode CUDA graphs,
a row per new token, rather than as the eager pass? The engine alone (llama3-8b,
bf16, dummy weights, async scheduling off so each step is timed alone): D
sequences decode at CONTEXT tokens; a request of P cached prefix tokens and N
new ones joins them, and the step that holds its chunk is launched one way or
the other (rows forced, or eager forced), REPEATS times each with fresh tokens:
the host's time launching the step, and the device's time running it (CUDA
events around the launch; on the CPU, the launch's wall time).

Under async scheduling a step costs about the larger of its launch and its
device time, so rows pay where rows' device time is below the eager pass's
larger one. Each point also says whether the engine's rule
(`ModelRunner.rows_pay`) takes rows there.

Usage: python -m bench.gpu.prompt_rows --out bench/results/prompt_rows.json [--device cpu]
Sections: ceilings, grid.
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch

from bench.gpu import ceilings
from bench.gpu.models import preset_folder
from bench.gpu.sections import Sections, script_parser
from engine import LLM, SamplingParams
from engine.cuda_graphs import DecodeGraphs

GPU = dict(preset="llama3-8b", dtype="bfloat16", load="dummy", context=1024, max_len=9216,
           decodes=(0, 32, 128, 200), prefixes=(0, 1008, 8000), news=(4, 16, 48),
           repeats=3)  # fmt: skip
DRY = dict(preset="tiny-llama", dtype="float32", load="auto", context=20, max_len=256,
           decodes=(0, 4), prefixes=(0, 32), news=(3, 9), repeats=1)  # fmt: skip


class StepTimer:
    """Wraps the runner's launch: a step holding a prompt chunk runs the way `mode`
    says (rows, eager) and is timed; other steps run as the engine decides."""

    def __init__(self, runner):
        self.runner, self.launch = runner, runner.launch
        self.mode, self.timed, self.rule = "", [], []
        runner.launch = self._launch

    def _launch(self, seqs, num_new, tables, force_eager=False, layer_hook=None):
        if not self.mode or sum(num_new) == len(seqs) or layer_hook is not None:
            return self.launch(seqs, num_new, tables, force_eager, layer_hook)
        runner = self.runner
        self.rule.append(runner.rows_pay(seqs, num_new))
        rows = self.mode == "rows"
        runner.rows_pay = lambda s, n: rows  # the instance's, over the method
        cuda = runner.device.type == "cuda"
        try:
            if cuda:
                torch.cuda.synchronize()
                begin, end = torch.cuda.Event(True), torch.cuda.Event(True)
                begin.record()
            start = time.perf_counter()
            out = self.launch(seqs, num_new, tables, force_eager=not rows)
            launch_ms = (time.perf_counter() - start) * 1e3
            if cuda:
                end.record()
                end.synchronize()
            device_ms = begin.elapsed_time(end) if cuda else launch_ms
        finally:
            del runner.rows_pay
        self.timed.append({"launch_ms": launch_ms, "device_ms": device_ms})
        return out


def _tokens(count: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count,), generator=g).tolist()


def grid(folder, setup: dict, device: str) -> list[dict]:
    llm = LLM(str(folder), dtype=setup["dtype"], device=device, load_format=setup["load"],
              async_scheduling=False, max_model_len=setup["max_len"])  # fmt: skip
    engine, runner = llm.engine, llm.engine.runner
    if runner.graphs is None:  # CPU: the graphs' buffers, replayed eagerly
        runner.graphs = DecodeGraphs(runner, 16, setup["max_len"])
    timer = StepTimer(runner)
    vocab = engine.model_config.vocab_size

    def tokens(count: int, seed: int) -> list[int]:
        return _tokens(count, seed, vocab)

    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for p in setup["prefixes"]:  # each prefix computed once: later requests hit it
        if p:
            llm.generate([tokens(p, p)], one)
    rows, seed = [], 1000
    try:
        for d in setup["decodes"]:
            keep = SamplingParams(max_tokens=setup["max_len"] - setup["context"] - 8,
                                  temperature=0, ignore_eos=True)  # fmt: skip
            ids = [f"decode-{d}-{i}" for i in range(d)]
            for i, rid in enumerate(ids):
                engine.add_request(rid, tokens(setup["context"], 10_000 + i), keep)
            while any(s.in_prefill for s in engine.scheduler.running + engine.scheduler.waiting):
                engine.step()
            for p, n in itertools.product(setup["prefixes"], setup["news"]):
                if d + n > runner.graphs.max_batch:
                    continue
                point = {"decodes": d, "prefix": p, "new": n}
                for mode in ("rows", "eager"):
                    timer.mode, timer.timed, timer.rule = mode, [], []
                    for _ in range(setup["repeats"]):
                        seed += 1
                        prompt = (tokens(p, p) if p else []) + tokens(n, seed)
                        engine.add_request(f"chunk-{seed}", prompt, one)
                        while f"chunk-{seed}" in engine.requests:
                            engine.step()
                    timer.mode = ""
                    point[mode] = {k: statistics.median(t[k] for t in timer.timed)
                                   for k in ("launch_ms", "device_ms")}  # fmt: skip
                    if mode == "rows":  # the rule sees the same shape both times
                        point["rule_takes_rows"] = bool(timer.rule and timer.rule[0])
                r, e = point["rows"], point["eager"]
                point["rows_pay"] = r["device_ms"] < max(e["launch_ms"], e["device_ms"])
                rows.append(point)
                print(point, flush=True)
            for rid in ids:
                engine.abort_request(rid)
            while engine.has_unfinished_requests():
                engine.step()
        return rows
    finally:
        llm.close()


def main(argv=None) -> dict:
    args = script_parser(__doc__).parse_args(argv)
    setup = GPU if args.device == "cuda" else DRY
    with Sections(args, script="prompt_rows", preset=setup["preset"]) as section:
        folder, _ = preset_folder(section.tmp, setup["preset"])
        section("ceilings", lambda: ceilings.measure(section.device))
        section("grid", lambda: grid(folder, setup, section.device))
        return section.results


if __name__ == "__main__":
    main()
