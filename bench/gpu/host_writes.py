"""What copying KV blocks to the host tier costs the steps running beside it, by
how the bytes move: the copy engine (the host tier's gather into a device
staging buffer, then one device-to-host copy a block, on a side stream) or a
kernel of a few programs storing the blocks straight into the pinned slots
(`kernels/host_blocks.py`), against steps with no copies at all.

A step here stands for a decode step: a CUDA graph reading ~15 GB of bf16
weights (as llama3-8b's decode does), then its sampled ids read back through
pinned memory and waited for, as the engine does. Between steps, every
`every` steps, a write of 64 blocks (a 1024-token prompt of llama3-8b: 32
layers x 2 x 16 x 8 x 128 bf16, 2 MiB a block) is issued on a side stream into
the host tier's memory (a shared-memory file pinned like the engine's). Each
case: step time p50/p90/p99 and the rate the writes reached; alone, one
write's time and GB/s against the pinned device-to-host ceiling measured in
the same run; and whether the bytes arrived whole.

Usage: python -m bench.gpu.host_writes --out bench/results/host_writes.json [--device cpu]
Sections: ceilings, alone, steps.
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch

from bench.gpu import ceilings
from bench.gpu.sections import Sections, script_parser
from engine.host_tier import HostTier, ids_on
from kernels.host_blocks import blocks_to_host

GPU = dict(layers=32, block=(2, 16, 8, 128), dtype=torch.bfloat16, cache=4096, slots=1024,
           write=64, steps=600, weights_gb=15.0, batch=16, width=28672)  # fmt: skip
DRY = dict(layers=2, block=(2, 4, 2, 8), dtype=torch.float32, cache=64, slots=32, write=4,
           steps=12, weights_gb=0.001, batch=2, width=256)  # fmt: skip
EVERY = (12, 4)  # steps between writes: ~2 GB/s at 5 ms steps (16 req/s of 1024-token
# prompts written once each), and three times that
PROGRAMS = (4, 8, 16)


class Rig:
    def __init__(self, s: dict, device: str):
        self.s, self.device = s, torch.device(device)
        full = torch.randn((s["layers"], s["cache"], *s["block"]), device=self.device).to(
            s["dtype"]
        )
        self.caches = list(full.unbind(0))
        per_block = s["layers"] * full[0, 0].numel() * full.element_size()
        self.host = HostTier(self.caches, s["slots"])
        self.block_bytes = per_block
        self.side = self.host.side
        self.cuda = self.device.type == "cuda"
        self.next_slot = 0
        # the step: a graph of products reading the weights, then an argmax to read back
        width = s["width"]
        count = max(1, int(s["weights_gb"] * 1e9 // (1024 * width * 2)))
        self.weights = [torch.randn(1024, width, device=device, dtype=torch.bfloat16)
                        for _ in range(count)]  # fmt: skip
        self.x = torch.randn(s["batch"], 1024, device=device, dtype=torch.bfloat16)
        self.graph = None
        if self.cuda:
            self._forward()
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self._forward()
        self.ids_pinned = torch.empty(s["batch"], dtype=torch.long, pin_memory=self.cuda)

    def _forward(self) -> torch.Tensor:
        acc = None
        for w in self.weights:
            y = (self.x @ w)[:, :1024]
            acc = y if acc is None else acc + y
        return acc.argmax(dim=1)

    def step(self) -> None:
        if self.graph is not None:
            self.graph.replay()
            self.ids_pinned.copy_(self.out, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
        else:
            self.ids_pinned.copy_(self._forward())

    def _pick(self) -> tuple[list[int], list[int]]:
        n, s = self.s["write"], self.s
        blocks = [(7 * (self.next_slot + i)) % s["cache"] for i in range(n)]
        slots = [(self.next_slot + i) % s["slots"] for i in range(n)]
        self.next_slot = (self.next_slot + n) % s["slots"]
        return blocks, slots

    def write(self, how: str) -> tuple[list[int], list[int]]:
        """Issues one write of `write` blocks on the side stream; returns (blocks, slots)."""
        blocks, slots = self._pick()
        if not self.cuda:
            self._issue(how, blocks, slots)
            return blocks, slots
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            self._issue(how, blocks, slots)
        return blocks, slots

    def _issue(self, how: str, blocks: list[int], slots: list[int]) -> None:
        if how == "copy_engine":  # the host tier's own path (HostTier._to_host)
            self.host._to_host([(SimpleNamespace(block_id=b), s) for b, s in zip(blocks, slots)])
        elif how == "copy_engine_one":  # the same, one copy for the run of slots
            staging = self.host._gather(ids_on(self.device, blocks))
            self.host.blocks[slots[0] : slots[0] + len(slots)].copy_(
                staging, non_blocking=self.cuda
            )
        else:  # "kernel:P"
            programs = int(how.split(":")[1])
            blocks_to_host(self.caches, self.host.blocks, ids_on(self.device, blocks),
                           ids_on(self.device, slots), programs)  # fmt: skip

    def whole(self, blocks: list[int], slots: list[int]) -> bool:
        if self.cuda:
            self.side.synchronize()
        return all(
            torch.equal(self.host.blocks[s][layer].view(torch.uint8),
                        self.caches[layer][b].cpu().view(torch.uint8))
            for b, s in zip(blocks[:4], slots[:4]) for layer in range(self.s["layers"])
        )  # fmt: skip


def alone(rig: Rig, cases: list[str]) -> dict:
    """One write at a time, nothing beside it: ms, GB/s, and whether it arrived whole."""
    out = {}
    nbytes = rig.s["write"] * rig.block_bytes
    for how in cases:
        times = []
        for _ in range(6):
            if rig.cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            blocks, slots = rig.write(how)
            if rig.cuda:
                rig.side.synchronize()
            times.append(time.perf_counter() - start)
        ms = statistics.median(times[1:]) * 1e3
        out[how] = {"ms": ms, "gbps": nbytes / (ms / 1e3) / 1e9, "whole": rig.whole(blocks, slots)}
    return out


def steps(rig: Rig, cases: list[str]) -> dict:
    out = {}
    for every in EVERY:
        for how in ["none", *cases]:
            times, issue, written = [], [], 0
            if rig.cuda:
                torch.cuda.synchronize()
            begin = time.perf_counter()
            for i in range(rig.s["steps"]):
                if how != "none" and i % every == 0:
                    start = time.perf_counter()
                    rig.write(how)
                    issue.append((time.perf_counter() - start) * 1e3)
                    written += rig.s["write"] * rig.block_bytes
                start = time.perf_counter()
                rig.step()
                times.append((time.perf_counter() - start) * 1e3)
            if rig.cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - begin
            qs = statistics.quantiles(times, n=100)
            out[f"every_{every}/{how}"] = {
                "step_ms_p50": statistics.median(times), "step_ms_p90": qs[89],
                "step_ms_p99": qs[98], "step_ms_mean": statistics.fmean(times),
                "written_gbps": written / elapsed / 1e9,
                "issue_ms_mean": statistics.fmean(issue) if issue else 0.0,
            }  # fmt: skip
    base = {e: out[f"every_{e}/none"] for e in EVERY}
    for key, row in out.items():
        e = int(key.split("/")[0].split("_")[1])
        for q in ("step_ms_p50", "step_ms_p99", "step_ms_mean"):
            row[f"{q}_to_none"] = row[q] / base[e][q]
    return out


def main(argv: list[str] | None = None) -> dict:
    args = script_parser(__doc__).parse_args(argv)
    s = GPU if args.device == "cuda" else DRY
    cases = ["copy_engine", "copy_engine_one", *(f"kernel:{p}" for p in PROGRAMS)]
    with Sections(args, script="host_writes") as section:
        device = section.device
        section("ceilings", lambda: ceilings.measure_with_host(device))
        rig = Rig(s, device)
        section("alone", lambda: alone(rig, cases))
        section("steps", lambda: steps(rig, cases))
        print_rows(section.results)
        return section.results


def print_rows(results: dict) -> None:
    for key, r in (results.get("steps") or {}).items():
        if isinstance(r, dict) and "step_ms_p50" in r:
            print(f"{key:28s} p50 {r['step_ms_p50']:.2f} ms ({r['step_ms_p50_to_none']:.3f}) "
                  f"p99 {r['step_ms_p99']:.2f} ({r['step_ms_p99_to_none']:.3f}) "
                  f"mean ({r['step_ms_mean_to_none']:.3f}) written {r['written_gbps']:.2f} "
                  f"GB/s, issued in {r['issue_ms_mean']:.2f} ms")  # fmt: skip
    for how, r in (results.get("alone") or {}).items():
        if isinstance(r, dict) and "ms" in r:
            print(f"alone {how:16s} {r['ms']:.2f} ms {r['gbps']:.1f} GB/s whole {r['whole']}")


if __name__ == "__main__":
    main()
