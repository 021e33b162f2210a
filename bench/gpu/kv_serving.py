"""What the KV tiers cost a mesh that serves traffic with no reuse: the default
`yinian up` mesh (KV store on, default host tier and write policy) beside one
with neither (`--no-kvstore --host-kv-cache-gb 0`), on the same Poisson load
(random 1024-token prompts generating 128, vLLM's `random` workload), each mesh
started once, warmed with other prompts at the top rate (kernels a first mesh would
tune for the first time must not count against it), then swept over the rates. For
each mesh: the sweep's rows, what its
workers wrote to the shared tier (bytes, bytes per second, dropped blocks) and
how many "put failed" lines its logs hold; then each figure's ratio to the bare
mesh's.

Usage: python -m bench.gpu.kv_serving --out bench/results/kv_serving.json
           [--rates 8,16,32] [--prompts-per-rate 320] [--device cpu]
           [--meshes default,bare[,no_writes,copy_engine,host_only,store_only,store_unlent,pieces]]
           [--profile]
Sections: ceilings, then each mesh of --meshes (then each one's ratios to the bare
mesh, printed and stored). A mesh named again runs again, stored as `name_2`, ...
(`--meshes bare,default,bare,default`: each kind of mesh both first and after the
other, since the first mesh of a run tunes the kernels for the shapes it meets
first (`kernel tuned` lines, counted in each sweep as `kernel_tunings`), and the
ratios pair each run with the bare run of the same round).
`no_writes`: the default mesh with `--kv-write-through none`, to tell what the
shared tier's writes cost from what the tiers' presence does;
`copy_engine`: the default mesh with `YINIAN_HOST_COPY=engine` (blocks go to the host
tier through the copy engine, not a kernel); `host_only` (`--no-kvstore`: the default
host tier, no store) and `store_only` (`--host-kv-cache-gb 0`: the store, no host tier),
to tell which tier costs what the default mesh pays; `store_unlent`: the default mesh
whose worker does not map and pin the store's memory tier (`--no-kv-lend`); `pieces`:
the default mesh with `--piece-graphs` (on by default on CUDA since s80: the same as
`default` there); `eager_prompts`: the default mesh with `--no-piece-graphs`.
`pooled_requests`: each kind's requests over all its runs (TTFT p50/p99, TPOT p99),
and each kind's over the bare runs' (bench/gpu/kv_serving_requests.py).
Each mesh's result also says where its worker's engine thread spent the sweep
(`engine`: steps a second, the host's and the device's time per step, each part
of the thread's time as a share of it; from the worker's metrics).
`--profile`: py-spy samples the worker, the gateway, the scheduler and the KV store
over each sweep (which slows them a little: figures from a profiled run are not
compared with others); the frames' ranking goes into the mesh's result as `profile`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

from bench.gpu import ceilings
from bench.gpu.kv_serving_compare import (
    kind_of,
    pairs,
    pooled,
    print_table,
    ratio_key,
    ratios,
    run_names,
)
from bench.gpu.kv_serving_requests import pooled_requests, print_pooled_requests
from bench.gpu.mesh_warmup import warm_up
from bench.gpu.models import preset_folder
from bench.gpu.py_profile import Profile, children
from bench.gpu.sections import Sections, script_parser
from engine.engine_thread import THREAD_PARTS
from yinian.mesh import Mesh, MeshSpec
from yinian.mesh_probe import wait_store_mapped, worker_metric

TUNED = "kernel tuned:"  # the line kernels/selection.py logs when it tunes a shape
ROW_KEYS = ("request_rate", "completed", "failed", "request_throughput", "output_throughput",
            "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")  # fmt: skip
# why a worker dropped a block it meant to write (its write queue was full, the block was
# no longer on the device or in the host tier, the store refused it)
DROP_REASONS = ("queue_full", "not_local", "store")


@dataclasses.dataclass(frozen=True)
class Load:
    preset: str
    input_len: int
    output_len: int
    rates: str
    prompts_per_rate: int
    warmup_prompts: int


GPU = Load("llama3-8b", 1024, 128, "8,16,32", 320, 64)
DRY = Load("tiny-llama", 32, 8, "16,inf", 4, 2)


def engine_argv(device: str) -> list[str]:
    dtype = "bfloat16" if device == "cuda" else "float32"
    return ["--device", device, "--dtype", dtype, "--load-format", "dummy",
            "--max-num-seqs", "256", "--max-model-len", "4096"]  # fmt: skip


# name -> (KV store on, the engine's extra flags, the worker's extra flags, environment)
MESHES = {
    "default": (True, [], [], {}),
    "bare": (False, ["--host-kv-cache-gb", "0"], [], {}),
    # the default mesh writing nothing to the shared tier: what the writes cost, apart
    "no_writes": (True, [], ["--kv-write-through", "none"], {}),
    # the default mesh copying blocks to the host tier through the copy engine
    "copy_engine": (True, [], [], {"YINIAN_HOST_COPY": "engine"}),
    # each tier alone, to tell which one costs what the default mesh pays: the host tier
    # without the store (`--no-kvstore`), the store without a host tier
    "host_only": (False, [], [], {}),
    "store_only": (True, ["--host-kv-cache-gb", "0"], [], {}),
    # the default mesh whose worker does not map (nor pin) the store's memory tier
    "store_unlent": (True, [], ["--no-kv-lend"], {}),
    # the default mesh with steps of prompt tokens as piece graphs (engine/piece_graphs.py)
    "pieces": (True, ["--piece-graphs"], [], {}),
    # ... and without them: each step with prompt tokens launched eagerly
    "eager_prompts": (True, ["--no-piece-graphs"], [], {}),
}


def sweep(load: Load, folder, device: str, out_dir, name: str, profile: bool = False) -> dict:
    from bench.loadgen.cli import run as bench_run
    from bench.loadgen.serve import written_runs

    kvstore, engine_extra, worker_extra, env = MESHES[kind_of(name)]
    spec = MeshSpec(model=str(folder), workers=1, port=0, kvstore=kvstore,
                    engine_argv=engine_argv(device) + engine_extra,
                    worker_argv=worker_extra, env=env)  # fmt: skip
    mesh = Mesh(spec)
    start = time.monotonic()
    mesh.start(timeout=900)
    started = time.monotonic() - start
    try:
        # a worker pins the store's memory tier in the background once ready (~10 s for
        # 16 GiB): the warm-up and the sweep start after it, as a mesh serving for long would
        mapped = wait_store_mapped(mesh) if kvstore and "--no-kv-lend" not in worker_extra else 0.0
        top = load.rates.split(",")[-1]
        warm_up(mesh.url, folder, load.preset, load.warmup_prompts, load.input_len,
                load.output_len, top, out_dir, f"{name}-warmup.json")  # fmt: skip
        before = _written(mesh)
        tunings = _log_lines(mesh, TUNED)
        start = time.monotonic()
        sampled = ["worker-0", "gateway", "scheduler"] + (["kvstore"] if kvstore else [])
        expected = sum(
            load.prompts_per_rate / float(r) for r in load.rates.split(",") if r != "inf"
        )
        profiler = Profile(children(mesh, sampled), expected) if profile else None
        with profiler or contextlib.nullcontext():  # py-spy stops with the sweep, come what may
            rc = bench_run([
                "serve", "--base-url", mesh.url, "--model", str(folder),
                "--model-name", load.preset, "--dataset-name", "random",
                "--num-prompts", str(load.prompts_per_rate),
                "--random-input-len", str(load.input_len), "--random-output-len",
                str(load.output_len), "--prompt-format", "ids", "--request-rates", load.rates,
                "--disable-tqdm", "--result-dir", str(out_dir),
                "--result-filename", f"{name}.json",
            ])  # fmt: skip
            seconds = time.monotonic() - start
            time.sleep(1.5)  # the workers' last reports (every 0.5 s; idle, every 1 s)
            after = _written(mesh)
            tunings = _log_lines(mesh, TUNED) - tunings
    finally:
        mesh.stop()
    runs = written_runs(out_dir, name)
    written = after["bytes"] - before["bytes"]
    return {
        "rc": rc,
        "start_seconds": started,
        "mapped_seconds": mapped,
        "sweep_seconds": seconds,
        "rows": [{k: r.get(k) for k in ROW_KEYS} for r in runs],
        "shared_written_bytes": written,
        "shared_written_bytes_per_s": written / seconds if seconds else 0.0,
        "shared_dropped_blocks": after["dropped"] - before["dropped"],
        "shared_dropped_by_reason": {r: after[r] - before[r] for r in DROP_REASONS},
        "host_bytes_to_host": after["to_host"],
        "put_failures_in_logs": _log_lines(mesh, "put failed"),
        "kernel_tunings": tunings,
        "engine": engine_times(before, after, seconds),
    } | ({"profile": profiler.top(40)} if profiler else {})


def _written(mesh: Mesh) -> dict:
    def total(name: str, where: str = "") -> float:
        return sum(worker_metric(mesh, name, where=where).values())

    dropped = "yinian:kv_shared_dropped_blocks_total"
    return {
        "bytes": total("yinian:kv_shared_bytes_total", 'direction="out"'),
        "dropped": total(dropped),
        "to_host": total("yinian:host_kv_bytes", 'direction="to_host"'),
        "steps": total("yinian:engine_steps", 'kind="all"'),
        "steps_timed": total("yinian:engine_steps", 'kind="device_timed"'),
        "wait": total("yinian:engine_step_seconds", 'kind="wait"'),
        "device": total("yinian:engine_step_seconds", 'kind="device"'),
    } | {reason: total(dropped, f'reason="{reason}"') for reason in DROP_REASONS} | {
        f"thread_{part}": total("yinian:engine_thread_seconds", f'part="{part}"')
        for part in THREAD_PARTS
    }  # fmt: skip


def engine_times(before: dict, after: dict, seconds: float) -> dict:
    """Where the worker's engine thread spent the sweep (from its metrics before and
    after): steps a second; per step, the host's time (the step's time less its
    wait for the device) and the device's own (over the steps it timed); each
    part's share of the thread's time over the sweep."""
    d = {k: after[k] - before[k] for k in after}
    steps = d["steps"] or 1
    total = sum(d[f"thread_{p}"] for p in THREAD_PARTS) or 1.0
    return {
        "steps": d["steps"],
        "steps_per_s": d["steps"] / seconds if seconds else 0.0,
        "host_ms_per_step": (d["thread_step"] - d["wait"]) / steps * 1e3,
        "wait_ms_per_step": d["wait"] / steps * 1e3,
        "device_ms_per_step": d["device"] / d["steps_timed"] * 1e3 if d["steps_timed"] else None,
        "thread_shares": {p: d[f"thread_{p}"] / total for p in THREAD_PARTS},
    }


def _log_lines(mesh: Mesh, needle: str) -> int:
    count = 0
    for path in mesh.log_dir.glob("*.log"):
        count += sum(needle in line for line in path.read_text(errors="replace").splitlines())
    return count


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--rates")
    parser.add_argument("--prompts-per-rate", type=int)
    parser.add_argument(
        "--meshes",
        default="default,bare",
        help=f"which meshes to sweep, in order (of {', '.join(MESHES)})",
    )
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    meshes = args.meshes.split(",")
    unknown = [m for m in meshes if m not in MESHES]
    if unknown:
        parser.error(f"--meshes: unknown {', '.join(unknown)}; known: {', '.join(MESHES)}")
    load = GPU if args.device == "cuda" else DRY
    load = dataclasses.replace(
        load,
        rates=args.rates or load.rates,
        prompts_per_rate=args.prompts_per_rate or load.prompts_per_rate,
    )
    with Sections(args, script="kv_serving", preset=load.preset) as section:
        device, out_dir = section.device, args.out.with_suffix("")
        out_dir.mkdir(parents=True, exist_ok=True)
        section("ceilings", lambda: ceilings.measure(device))
        folder, _ = preset_folder(section.tmp, load.preset)
        runs = {}
        names = run_names(meshes)
        for name in names:
            runs[name] = section(
                name, lambda name=name: sweep(load, folder, device, out_dir, name, args.profile)
            )
        compared = dict(pairs(names))
        for name, bare_name in compared.items():
            run, bare = runs.get(name) or {}, runs.get(bare_name) or {}
            if "rows" in run and "rows" in bare:
                section.results[ratio_key(name)] = ratios(run, bare)
        section.results["compared_with"] = compared
        section.results["pooled_to_bare"] = pooled(section.results, names)
        rates = [float(r) for r in load.rates.split(",")]
        section.results["pooled_requests"] = pooled_requests(out_dir, names, rates)
        print_table(section.results, names)
        print_pooled_requests(section.results["pooled_requests"])
        print_engine_times(section.results, names)
        return section.results


def print_engine_times(results: dict, names: list[str]) -> None:
    for name in names:
        e = (results.get(name) or {}).get("engine")
        if not e:
            continue
        device = e["device_ms_per_step"]
        shares = " ".join(f"{p} {v:.2f}" for p, v in e["thread_shares"].items())
        print(
            f"{name}: {e['steps']:.0f} steps, {e['steps_per_s']:.1f}/s; per step host "
            f"{e['host_ms_per_step']:.2f} ms, wait {e['wait_ms_per_step']:.2f}, device "
            f"{'-' if device is None else f'{device:.2f}'}; engine thread: {shares}"
        )


if __name__ == "__main__":
    main()
