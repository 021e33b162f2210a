"""The KV store's benchmark: the tiers' ceilings and load path, one prompt's time
to first token with its prefix in each tier, and a multi-turn workload through
`yinian bench serve` with the store on and off.

On the GPU: llama3-8b (bf16, dummy weights), an 8k-token prefix, the workload on
two workers (200 conversations of 5 turns, histories growing to about 8k tokens,
32 in flight: near saturation; each device pool holds a fraction of them), 32
conversations under way at a time (a user's turns back to back: every first turn
before any second turn would ask the tiers to hold all 200 histories at once,
about 160 GiB of llama3-8b KV by the fifth turn, more than the host's memory). With
`--device cpu` the same on tiny-llama: a dry run at tiny sizes, or, with
`--conversations 200 --turns 5`, the CPU acceptance run (histories growing to
about 2k tokens).

Usage: python -m bench.gpu.kvstore --out bench/results/kvstore.json
           [--skip ...] [--device cpu] [--conversations N] [--turns N]
           [--traces] [--profile] [--runs off,on] [--earlier PATH] [--rate R]
`--rate`: the workload's turns a second, Poisson (default inf: each turn as soon as
one of the 32 places frees, a saturated mesh whose TTFT is mostly the wait for a place).
`--traces`: the tier mesh's services export their spans here, and the device hit's
stages are recorded (exporting them costs the services time: the TTFTs of such a run
are not comparable). `--profile`: py-spy samples the engine alone and the tier
mesh's worker, gateway and scheduler over repeated device hits (ranked frames in the
results). `--runs`: which workload runs (the store off, on, or both); `--earlier
PATH`: the other run's `yinian bench serve` result (JSON, or gzipped) from an earlier
call, compared with this one's (figures and greedy texts).
Sections: ceilings, host_load, ttft_by_tier, cross_worker, workload.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

from bench.gpu import ceilings
from bench.gpu.kv_tiers import cross_worker, host_load, ttft_by_tier
from bench.gpu.kv_workload import Workload, run_workload
from bench.gpu.models import preset_folder
from bench.gpu.sections import Sections, script_parser
from bench.loadgen.datasets import load_tokenizer, random_requests
from bench.otlp_receiver import OtlpReceiver
from yinian.mesh import Mesh, MeshSpec


@dataclasses.dataclass(frozen=True)
class Setup:
    preset: str
    dtype: str
    prefix_len: int  # the prompt of ttft_by_tier
    device_blocks: int  # a device pool smaller than what the runs cache
    host_gb: float
    load_blocks: int
    workload: Workload


GPU = Setup("llama3-8b", "bfloat16", 8192, 2048, 16.0, 512,
            Workload(conversations=200, turns=5, system_len=512, user_len=1400,
                     output_len=128, concurrency=32, workers=2,
                     active_conversations=32))  # fmt: skip
DRY = Setup("tiny-llama", "float32", 400, 96, 0.02, 64,
            Workload(conversations=6, turns=3, system_len=64, user_len=40,
                     output_len=8, concurrency=3, workers=2,
                     active_conversations=3))  # fmt: skip
CPU_FULL = Workload(conversations=200, turns=5, system_len=400, user_len=300,
                    output_len=16, concurrency=8, workers=1)  # fmt: skip


def engine_argv(setup: Setup, device: str, store: bool) -> list[str]:
    argv = [
        "--device",
        device,
        "--dtype",
        setup.dtype,
        "--num-gpu-blocks",
        str(setup.device_blocks),
        "--host-kv-cache-gb",
        str(setup.host_gb if store else 0),
    ]
    return argv + (["--load-format", "dummy"] if setup.preset not in ("tiny-llama",) else [])


def tier_mesh(folder, setup: Setup, device: str, traces: OtlpReceiver | None) -> Mesh:
    # every block goes down (an 8k prompt is 1 GiB of llama3-8b KV), and the shared tier
    # holds the prompt and its fillers; the services' spans go to `traces`, if given
    env = {} if traces is None else {"OTEL_EXPORTER_OTLP_ENDPOINT": traces.endpoint,
                                     "OTEL_BSP_SCHEDULE_DELAY": "200"}  # fmt: skip
    spec = MeshSpec(model=str(folder), workers=1, port=0, kvstore=True,
                    engine_argv=engine_argv(setup, device, store=True),
                    worker_argv=["--kv-write-through", "all", "--kv-write-queue-bytes", "16GiB"],
                    kvstore_argv=["--capacity-bytes", str(32 << 30)], env=env)  # fmt: skip
    return Mesh(spec).start(timeout=1800)


def _cross_worker(folder, setup: Setup, device: str, prompt, warm) -> dict:
    """Two workers of half the device memory each, the default store and write policy."""
    argv = ["--device", device, "--dtype", setup.dtype, "--gpu-memory-utilization", "0.45"]
    if setup.preset != "tiny-llama":
        argv += ["--load-format", "dummy"]
    spec = MeshSpec(model=str(folder), workers=2, port=0, kvstore=True,
                    engine_argv=argv)  # fmt: skip
    mesh = Mesh(spec).start(timeout=1800)
    try:
        return cross_worker(mesh, setup.preset, prompt, warm)
    finally:
        mesh.stop()


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--conversations", type=int)
    parser.add_argument("--turns", type=int)
    parser.add_argument("--rate", type=float, help="the workload's turns a second (inf)")
    parser.add_argument("--traces", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--runs", default="off,on")
    parser.add_argument("--earlier", type=Path, help="the other run's bench-serve result")
    args = parser.parse_args(argv)
    earlier = _read_result(args.earlier) if args.earlier else None
    setup = GPU if args.device == "cuda" else DRY
    if args.device == "cpu" and args.conversations:
        setup = dataclasses.replace(setup, device_blocks=2048, host_gb=0.05,
                                    workload=CPU_FULL)  # fmt: skip
    w = dataclasses.replace(setup.workload, conversations=args.conversations
                            or setup.workload.conversations,
                            turns=args.turns or setup.workload.turns,
                            rate=args.rate or setup.workload.rate)  # fmt: skip
    with Sections(args, script="kvstore", preset=setup.preset) as section:
        device = section.device
        folder, _ = preset_folder(section.tmp, setup.preset)
        engine = {
            "device": device,
            "dtype": setup.dtype,
            "host_kv_cache_gb": setup.host_gb,
            "load_format": "auto" if setup.preset == "tiny-llama" else "dummy",
        }
        section("ceilings", lambda: ceilings.measure_with_host(device))
        tok = load_tokenizer(folder)
        # enough fillers of the prompt's length to push it out of the device pool
        count = 2 + setup.device_blocks * 16 // setup.prefix_len + 1
        prompt, warm, *fillers = [r.prompt for r in random_requests(
            tok, count, setup.prefix_len, 4, seed=7, prompt_format="ids")]  # fmt: skip
        section("host_load", lambda: host_load(
            str(folder), engine, setup.load_blocks, prompt, args.profile))  # fmt: skip
        traces = OtlpReceiver().start() if args.traces else None
        mesh = section.resource(lambda: tier_mesh(folder, setup, device, traces), Mesh.stop)
        section("ttft_by_tier", lambda: ttft_by_tier(
            mesh(), setup.preset, prompt, fillers, warm, traces, args.profile))  # fmt: skip
        if traces is not None:
            traces.stop()
        mesh.close()  # one mesh at a time
        section("cross_worker",
                lambda: _cross_worker(folder, setup, device, prompt, fillers[:4]))  # fmt: skip
        section(
            "workload",
            lambda: run_workload(
                folder,
                setup.preset,
                w,
                lambda store: engine_argv(setup, device, store),
                args.out.with_suffix(""),
                runs=args.runs.split(","),
                earlier=earlier,
            ),
        )
        print_table(section.results)
        return section.results


def _read_result(path: Path) -> dict:
    """A `yinian bench serve` result file, plain or gzipped JSON."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def print_table(results: dict) -> None:
    c, load = results.get("ceilings") or {}, results.get("host_load") or {}
    if "gbps" in load:
        ceiling = c.get("pinned_h2d_gbps") or c.get("copy_gbps")
        print(f"host tier load: {load['gbps']:.1f} GB/s ({load['blocks']} blocks), "
              f"{load['gbps'] / ceiling:.2f} of the copy ceiling")  # fmt: skip
    if "engine_ttft" in load:
        e = load["engine_ttft"]
        print(f"engine alone: TTFT recomputed {e['none_ms']:.1f} ms, device hit "
              f"{e['gpu_ms']:.1f} ms, a 3-token prompt {e['short_prompt_ms']:.1f} ms")  # fmt: skip
    tiers = results.get("ttft_by_tier") or {}
    if "none" in tiers:
        for tier in ("none", "gpu", "host", "shared"):
            row = tiers[tier]
            print(f"TTFT, prefix {tier:6}: {row['ttft_ms']:8.1f} ms, "
                  f"cached {row['cached_tokens']}")  # fmt: skip
        print(f"TTFT, a 3-token prompt: {tiers['short_prompt_ms']:.1f} ms")
        print("speed-up over none:", json.dumps(tiers["speedup_over_none"]))
        print("shared tier fetched by path:", json.dumps(tiers.get("shared_fetched_by_path")))
        print("answer as recomputed:", json.dumps(tiers.get("same_as_none")),
              "as the device hit:", json.dumps(tiers.get("same_as_gpu")))  # fmt: skip
        for what, key in (("device hit", "gpu_stages"), ("3 tokens", "short_stages")):
            for stage, row in (tiers.get(key) or {}).items():
                print(f"  {what}: {stage:44} +{row['start_ms']:7.2f} ms  {row['ms']:7.2f} ms")
    cross = results.get("cross_worker") or {}
    if "other" in cross:
        print(
            f"TTFT, prefix computed on another worker: {cross['other']['ttft_ms']:.1f} ms "
            f"(recompute {cross['none']['ttft_ms']:.1f} ms: {cross['other_over_none']:.2f}x), "
            f"cached {cross['other']['cached_tokens']}, "
            f"answer as the device hit's {cross.get('same_as_gpu')}, "
            f"fetched {json.dumps(cross.get('fetched_by_path'))} in {cross['fetch_ms']:.0f} ms"
        )
    work = results.get("workload") or {}
    for name in ("off", "on"):
        if name in work:
            r = work[name]
            print(f"store {name:3}: {r['request_throughput']:.2f} req/s, TTFT p50 "
                  f"{r['median_ttft_ms']:.0f} ms p99 {r['p99_ttft_ms']:.0f} ms, cached of ideal "
                  f"{r['cached_of_ideal']:.3f}")  # fmt: skip
            if "placed_prefix_blocks" in r:  # a run of this call (not an earlier one's)
                placed, hits = r["placed_prefix_blocks"], r["hit_tokens"]
                print(f"  placed where the index saw {placed['chosen']:.0f} of the longest "
                      f"{placed['longest']:.0f} cached blocks; the engines found "
                      f"{hits['gpu'] + hits['host'] + hits['shared']:.0f} cached tokens; "
                      f"per worker {r['per_worker']}; index gaps {placed['index_gaps']:.0f}, "
                      f"host-tier blocks indexed {r['index_host_blocks']}")  # fmt: skip
    if "outputs_equal" in work:
        print("greedy outputs equal with the store on and off:", work["outputs_equal"])


if __name__ == "__main__":
    main()
