"""Copying KV blocks from host memory into device blocks, by where the memory came
from: a worker's host tier (a shared-memory file it made and pinned whole) against
the KV store's memory tier (the store's file, mapped and pinned in chunks by the
worker: engine/store_memory.py), each with and without the blocks' checksums run
beside the copy; and how long pinning the store's file takes.

On the GPU: llama3-8b's block (32 layers x 2 x 16 x 8 x 128, bf16: 2 MiB), 512
blocks (1 GiB) into a 2048-block cache, against the pinned host-to-device
ceiling measured in the same run. `--device cpu`: the same code on tiny sizes.

Usage: python -m bench.gpu.lend_copy --out bench/results/lend_copy.json [--device cpu]
Sections: ceilings, host_tier, store_region.
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from bench.gpu import ceilings
from bench.gpu.sections import Sections, script_parser
from bench.gpu.timing import median_ms
from engine.host_memory import allocate
from engine.host_tier import copy_rows_to_blocks
from engine.store_memory import StoreMemory
from services.common.kv_checksum import block_checksum
from services.kvstore.memory_region import MemoryRegion

GPU = dict(layers=32, block=(2, 16, 8, 128), dtype=torch.bfloat16, blocks=512, cache=2048,
           store_gb=16.0)  # fmt: skip
DRY = dict(layers=2, block=(2, 4, 2, 8), dtype=torch.float32, blocks=16, cache=32, store_gb=0.01)


def _caches(setup: dict, device: str) -> list[torch.Tensor]:
    return [torch.zeros((setup["cache"], *setup["block"]), dtype=setup["dtype"], device=device)
            for _ in range(setup["layers"])]  # fmt: skip


def _copy_rate(rows: list[torch.Tensor], caches, device: str, verify: bool) -> dict:
    """GB/s of copying `rows` into cache blocks 1..n (with their checksums computed in
    threads meanwhile, if `verify`), and whether every block arrived whole."""
    ids = list(range(1, len(rows) + 1))
    pool = ThreadPoolExecutor(min(8, os.cpu_count() or 1))
    flat = [r.view(torch.uint8).view(-1) for r in rows]

    def run():
        checks = [pool.submit(block_checksum, f.numpy()) for f in flat] if verify else []
        copy_rows_to_blocks(rows, ids, caches)
        for c in checks:
            c.result()

    ms = median_ms(run, device, iters=10)
    nbytes = sum(f.numel() for f in flat)
    whole = all(  # bytes, not values: random bytes hold NaNs
        torch.equal(caches[layer][ids[i]].cpu().view(torch.uint8), rows[i][layer].view(torch.uint8))
        for i in (0, len(rows) - 1) for layer in (0, len(caches) - 1)
    )  # fmt: skip
    pool.shutdown()
    return {"ms": ms, "gbps": nbytes / ms / 1e6, "blocks": len(rows), "whole": whole}


def host_tier(setup: dict, device: str) -> dict:
    shape = (setup["blocks"], setup["layers"], *setup["block"])
    memory = allocate(shape, setup["dtype"], device == "cuda")
    try:
        memory.tensor.view(torch.uint8).random_(0, 255)
        caches = _caches(setup, device)
        rows = [memory.tensor[i] for i in range(setup["blocks"])]
        return {"shared_file": memory.path is not None, "pinned": memory.registered,
                "copy": _copy_rate(rows, caches, device, verify=False),
                "copy_with_checksums": _copy_rate(rows, caches, device, verify=True)}  # fmt: skip
    finally:
        memory.close()


def store_region(setup: dict, device: str) -> dict:
    block_bytes = setup["layers"] * math.prod(setup["block"]) * setup["dtype"].itemsize
    slots = int(setup["store_gb"] * (1 << 30)) // block_bytes
    region = MemoryRegion(slots, block_bytes)
    try:
        if region.shared is None:
            return {"skipped": "needs room for the store's file in the shared-memory folder"}
        rows_np = region.rows[: setup["blocks"]]
        rows_np[:] = np.random.default_rng(0).integers(0, 256, rows_np.shape, dtype=np.uint8)
        start = time.monotonic()
        mapped = StoreMemory(*region.shared, block_bytes, device == "cuda")
        pin_seconds = time.monotonic() - start
        try:
            shape = (setup["layers"], *setup["block"])
            rows = [mapped.view(i * block_bytes, block_bytes).view(setup["dtype"]).view(shape)
                    for i in range(setup["blocks"])]  # fmt: skip
            caches = _caches(setup, device)
            plain = _copy_rate(rows, caches, device, verify=False)
            checked = _copy_rate(rows, caches, device, verify=True)
            return {"region_bytes": region.size, "pinned": mapped.pinned,
                    "map_and_pin_seconds": pin_seconds, "copy": plain,
                    "copy_with_checksums": checked}  # fmt: skip
        finally:
            mapped.close()
    finally:
        region.close()


def main(argv: list[str] | None = None) -> dict:
    args = script_parser(__doc__).parse_args(argv)
    setup = GPU if args.device == "cuda" else DRY
    with Sections(args, script="lend_copy") as section:
        device = section.device
        section("ceilings", lambda: ceilings.measure_with_host(device))
        section("host_tier", lambda: host_tier(setup, device))
        section("store_region", lambda: store_region(setup, device))
        print_table(section.results)
        return section.results


def print_table(results: dict) -> None:
    ceiling = (results.get("ceilings") or {}).get("pinned_h2d_gbps")
    for name in ("host_tier", "store_region"):
        row = results.get(name) or {}
        for how in ("copy", "copy_with_checksums"):
            if how in row:
                r = row[how]
                share = f", {r['gbps'] / ceiling:.2f} of pinned H2D" if ceiling else ""
                print(f"{name:12} {how:20} {r['ms']:8.2f} ms  {r['gbps']:6.1f} GB/s{share}"
                      f"  whole {r['whole']}")  # fmt: skip
    if "map_and_pin_seconds" in (results.get("store_region") or {}):
        r = results["store_region"]
        print(f"store region: {r['region_bytes'] / (1 << 30):.1f} GiB mapped and pinned in "
              f"{r['map_and_pin_seconds']:.1f} s (pinned: {r['pinned']})")  # fmt: skip


if __name__ == "__main__":
    main()
