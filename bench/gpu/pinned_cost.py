"""Whether host memory registered with the CUDA driver slows an engine's steps.

Every mesh with a KV tier below the device pins many GiB of shared memory: the
worker's host tier (a `/dev/shm` file, registered portable and mapped) and the
KV store's memory tier, which the worker maps and registers in chunks. On the
H200, 8 req/s of fresh 1024 -> 128 prompts, each such mesh took more host and
device time a step than the mesh with neither (bench/results/kv_serving_s59*.json).
Here one engine (llama3-8b, bf16, dummy weights, no host tier) is measured in
turn with nothing registered, a host-tier-like region registered, a store-like
region alone, both, then as much memory pinned by the driver's own allocator
(`torch.empty(pin_memory=True)`, not a `/dev/shm` file) alone, then nothing, twice
over: the same steps, the only difference the pinned memory. Then, with nothing
registered, the same engine settings with a host tier of that size (its
bookkeeping and its own registration) are built and measured once more. The
ceilings also hold the host's transparent huge page settings.

Per state: pure decode (batch 32 at 1k context: ms a step), mixed work (48 fresh
1024 -> 128 prompts offline: output tokens/s, the engine's host and device time
a step), launch cost (µs per small op queued) and the device copy bandwidth.

Usage: python -m bench.gpu.pinned_cost --out bench/results/pinned_cost.json [--gib 16]
Sections: ceilings, registered (every state, in order), host_tier; prints each
state's figures over the first "none" state's. The dry run (`--device cpu`) runs
the same states on tiny-llama with nothing registered (there is no driver).
"""

from __future__ import annotations

import itertools
import os
import time

import torch

from basis.host_regions import STORE_PREFIX, shm_dir
from bench.gpu.ceilings import copy_bandwidth, measure
from bench.gpu.engine_rates import decode_rate, offline_throughput, sync
from bench.gpu.models import preset_folder
from bench.gpu.sections import Sections, script_parser
from engine import LLM
from engine.host_memory import allocate
from engine.store_memory import StoreMemory

GPU = ("llama3-8b", 32, 1024, 64, 48, 128)  # preset, decode batch, context, steps, prompts, out
DRY = ("tiny-llama", 4, 32, 8, 4, 8)
STATES = ("none", "host", "store", "host+store", "alloc", "none") * 2
GRANULE = 2 << 20  # a llama3-8b block


def engine_options(device: str, host_gb: float) -> dict:
    """A mesh worker's engine (bench/gpu/kv_serving.py); a host tier of `host_gb`
    copying what the default tier copies (a reused block, when the device evicts it)."""
    cuda = device == "cuda"
    return dict(dtype="bfloat16" if cuda else "float32", device=device, load_format="dummy",
                kernels="auto" if cuda else "torch", max_num_seqs=256, max_model_len=4096,
                host_kv_cache_gb=host_gb, host_kv_backup="reused" if host_gb else None)  # fmt: skip


def step_figures(llm: LLM) -> dict:
    s = llm.engine.get_stats()
    return {k: s[k] for k in ("num_steps", "step_wait_seconds", "step_device_seconds",
                              "steps_device_timed")}  # fmt: skip


def launch_us(llm: LLM, ops: int = 2000) -> float:
    """The µs a small op takes to queue and run on the engine's device."""
    x = torch.zeros(16, device=llm.engine.facts.device)
    sync(llm)
    start = time.perf_counter()
    for _ in range(ops):
        x.add_(1.0)
    sync(llm)
    return (time.perf_counter() - start) / ops * 1e6


_SEEDS = itertools.count(100)  # each mixed run's prompts its own: no prefix cache hits


def measure_state(llm: LLM, shape: tuple, device: str) -> dict:
    _, batch, context, steps, prompts, out = shape
    before = step_figures(llm)
    mixed = offline_throughput(llm, prompts, context, out, seed=next(_SEEDS))
    after = step_figures(llm)
    d = {k: after[k] - before[k] for k in after}
    n = d["num_steps"] or 1
    elapsed = mixed["elapsed_s"]
    return {
        "decode_step_ms": decode_rate(llm, batch, context, steps)["step_ms"],
        "mixed_output_tokens_per_s": mixed["output_tokens_per_s"],
        "mixed_steps": d["num_steps"],
        "mixed_ms_per_step": elapsed / n * 1e3,
        "mixed_wait_ms_per_step": d["step_wait_seconds"] / n * 1e3,
        "mixed_device_ms_per_step": (
            d["step_device_seconds"] / d["steps_device_timed"] * 1e3
            if d["steps_device_timed"] else None
        ),
        "launch_us_per_op": launch_us(llm),
        "copy_gbps": copy_bandwidth(1 << 30 if device == "cuda" else 1 << 20, device),
    }  # fmt: skip


def huge_page_settings() -> dict:
    folder = "/sys/kernel/mm/transparent_hugepage"
    out = {}
    for name in ("enabled", "shmem_enabled"):
        try:
            with open(f"{folder}/{name}") as f:
                out[name] = f.read().strip()
        except OSError as exc:
            out[name] = f"unreadable: {exc}"
    return out


class Registered:
    """A host-tier-like region (engine/host_memory.allocate: a /dev/shm file,
    registered portable and mapped) and a store-like one (a `yinian-store-` file
    mapped and registered in chunks by engine/store_memory.StoreMemory)."""

    def __init__(self, nbytes: int, cuda: bool):
        self.nbytes, self.cuda = nbytes, cuda
        self.host = self.store = self.alloc = None
        self.store_path = shm_dir() / f"{STORE_PREFIX}{os.getpid()}-bench"

    def set(self, state: str) -> float:
        """Moves to `state` ("none", or its regions joined by "+"), unpinning what it
        does not hold; the seconds the (un)registrations took."""
        parts = set(state.split("+")) - {"none"}
        start = time.perf_counter()
        self.close(keep=parts)
        if "host" in parts and self.host is None:
            self.host = allocate((self.nbytes,), torch.uint8, self.cuda)
        if "store" in parts and self.store is None:
            with open(self.store_path, "wb") as f:
                f.truncate(self.nbytes)
            self.store = StoreMemory(str(self.store_path), self.nbytes, GRANULE, self.cuda)
        if "alloc" in parts and self.alloc is None:
            self.alloc = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        return time.perf_counter() - start

    def close(self, keep: set[str] = frozenset()) -> None:
        if "alloc" not in keep:
            self.alloc = None
        if "host" not in keep and self.host is not None:
            self.host.close()
            self.host = None
        if "store" not in keep and self.store is not None:
            self.store.close()
            self.store = None
            self.store_path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--gib", type=float, default=16.0, help="each region's size")
    args = parser.parse_args(argv)
    shape = GPU if args.device == "cuda" else DRY
    with Sections(args, script="pinned_cost", preset=shape[0]) as section:
        device = section.device
        section("ceilings", lambda: measure(device) | {"thp": huge_page_settings()})
        folder, _ = preset_folder(section.tmp, shape[0])
        nbytes = int(args.gib * (1 << 30)) if section.cuda else 1 << 20

        def registered() -> list[dict]:
            llm = LLM(folder, **engine_options(device, 0.0))
            regions = Registered(nbytes, section.cuda)
            rows = []
            try:
                measure_state(llm, shape, device)  # warm-up: graphs, allocator, caches
                for state in STATES:
                    seconds = regions.set(state)
                    sync(llm)
                    rows.append({"state": state, "register_seconds": seconds}
                                | measure_state(llm, shape, device))  # fmt: skip
                    print(rows[-1], flush=True)
            finally:
                regions.close()
                llm.close()
            return rows

        section("registered", registered)

        def host_tier() -> dict:
            llm = LLM(folder, **engine_options(device, args.gib if section.cuda else 0.001))
            try:
                measure_state(llm, shape, device)
                return {"host_tier_gb": args.gib} | measure_state(llm, shape, device)
            finally:
                llm.close()

        section("host_tier", host_tier)
        print_summary(section.results)
        return section.results


def print_summary(results: dict) -> None:
    rows = results.get("registered")
    if not isinstance(rows, list) or not rows:
        return
    base = rows[0]
    keys = [k for k, v in base.items() if isinstance(v, float) and k != "register_seconds"]
    extra = results.get("host_tier")
    labelled = [(r["state"], r) for r in rows] + (
        [("host tier (engine)", extra)] if isinstance(extra, dict) and "copy_gbps" in extra else []
    )
    print("state: " + ", ".join(keys) + "  (over the first 'none')")
    for label, r in labelled:
        cells = [f"{r[k] / base[k]:.3f}" if r.get(k) and base.get(k) else "-" for k in keys]
        print(f"{label}: " + " ".join(cells))


if __name__ == "__main__":
    main()
