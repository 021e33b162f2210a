"""The KV store's workload: multi-turn conversations through `yinian bench serve`
(token-id prompts, so the ideal reuse is exact), once on a mesh without the store
(device prefix cache only) and once with it (host tier, KV store, Redis, write
through `all`), on the same device pools and number of workers. Recorded per run:
throughput, TTFT, the cached prompt tokens against the ideal, where the hits came
from (device, host, shared tier), fragmentation sampled while it ran; and whether
every greedy answer was the same in both runs."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

from bench.loadgen.cli import run as bench_run
from yinian.mesh import Mesh, MeshSpec
from yinian.mesh_probe import http_get, placer_metric, sample_sum, scheduler_metric, worker_metric

SUMMARY = ("completed", "failed", "duration", "request_throughput", "output_throughput",
           "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
           "prompt_tokens_total", "cached_tokens_total", "ideal_cached_tokens_total",
           "cached_of_ideal", "upper_cached_tokens_total", "cached_of_upper")  # fmt: skip


FRAGMENTATION = "yinian:kv_fragmentation_ratio"


@dataclasses.dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    system_len: int
    user_len: int
    output_len: int
    concurrency: int  # conversations in flight (each one turn at a time)
    workers: int = 1
    # conversations under way at most (a user's turns come back to back, a new user
    # starting when one is done); None: every first turn before any second turn, which
    # asks the tiers to hold every conversation's history at once
    active_conversations: int | None = None
    # turns a second (Poisson; a turn still waits for its conversation's previous one):
    # inf sends each as soon as a place under `concurrency` frees (saturated: TTFT is
    # then mostly the wait for a place, whatever the tiers save); a rate below the
    # store-off mesh's throughput is "near saturation"
    rate: float = float("inf")


class _Sampler:
    """Samples gauges while the workload runs (their value at the end says nothing: the
    cache is idle by then): `read` returns the values of one sample."""

    def __init__(self, read, every: float = 0.5):
        self.read, self.every = read, every
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.samples += self.read()
            except Exception:  # noqa: BLE001 - a missed sample is not a result
                pass

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        busy = [s for s in self.samples if s > 0]
        return {"max": max(busy, default=0.0), "mean": sum(busy) / len(busy) if busy else 0.0,
                "min": min(busy, default=0.0), "samples": len(busy)}  # fmt: skip


def _serve(mesh: Mesh, folder, model: str, w: Workload, out_dir: Path, name: str) -> dict:
    rc = bench_run([
        "serve", "--base-url", mesh.url, "--model", str(folder), "--model-name", model,
        "--dataset-name", "multi-turn", "--num-prompts", str(w.conversations * w.turns),
        "--multi-turn-num-turns", str(w.turns), "--multi-turn-system-len", str(w.system_len),
        "--multi-turn-user-len", str(w.user_len), "--multi-turn-output-len", str(w.output_len),
        "--prompt-format", "ids", "--max-concurrency", str(w.concurrency),
        *(["--max-active-conversations", str(w.active_conversations)]
          if w.active_conversations else []),
        "--request-rate", str(w.rate), "--num-warmups", "0", "--disable-tqdm", "--no-plots",
        "--result-dir", str(out_dir), "--result-filename", f"workload-{name}",
    ])  # fmt: skip
    result = json.loads((out_dir / f"workload-{name}.json").read_text())
    result["rc"] = rc
    return result


def _tiers(mesh: Mesh) -> dict:
    def total(metric: str, where: str = "") -> float:
        return sum(worker_metric(mesh, metric, where=where).values())

    queried = total("yinian:prefix_cache_queried_tokens")
    # shared-tier blocks land on the device (lent by the store's memory tier) or in the
    # host tier (copied): the engine then counts their hits there
    lent = total("yinian:kv_shared_fetched_tokens_total", 'path="lent"')
    copied = total("yinian:kv_shared_fetched_tokens_total", 'path="copied"')
    hits = {"gpu": total("yinian:prefix_cache_hit_tokens", 'tier="gpu"') - lent,
            "host": total("yinian:prefix_cache_hit_tokens", 'tier="host"') - copied,
            "shared": lent + copied, "shared_lent": lent}  # fmt: skip
    dropped = "yinian:kv_shared_dropped_blocks_total"
    shared = {
        "written_bytes": total("yinian:kv_shared_bytes_total", 'direction="out"'),
        "dropped_blocks": total(dropped),
    } | {
        f"dropped_{r}": total(dropped, f'reason="{r}"')
        for r in ("queue_full", "not_local", "store")
    }
    prefetches = {o: total("yinian:kv_shared_prefetches_total", f'outcome="{o}"')
                  for o in ("not_indexed", "local", "filled", "missed")}  # fmt: skip
    # where the requests went and what they found there: the KV index's prefix at the
    # chosen worker against the longest any worker held (placement giving cache up for
    # load), each worker's requests and preemptions (a preempted prompt is admitted and
    # counted again)
    placed = {k: placer_metric(mesh, "yinian:placed_prefix_blocks_total", f'kind="{k}"')
              for k in ("chosen", "longest")}  # fmt: skip
    placed["index_gaps"] = placer_metric(mesh, "yinian:kv_index_gaps_total")  # every index
    per_worker = {name: worker_metric(mesh, metric) for name, metric in (
        ("requests", "yinian:worker_requests_total"),
        ("preemptions", "yinian:num_preemptions"))}  # fmt: skip
    for kind in ("cached", "evicted", "refused"):
        per_worker[f"host_blocks_{kind}"] = worker_metric(
            mesh, "yinian:host_kv_blocks", where=f'kind="{kind}"'
        )
    return {"queried_tokens": queried, "hit_tokens": hits, "shared_prefetches": prefetches,
            "placed_prefix_blocks": placed, "per_worker": per_worker, "store": _store(mesh),
            "hit_rate": {t: v / queried if queried else 0.0 for t, v in hits.items()},
            "shared_writes": shared,
            "host_bytes_to_host": total("yinian:host_kv_bytes", 'direction="to_host"')}  # fmt: skip


def _store(mesh: Mesh) -> dict:
    """What the KV store's metrics say it did: blocks in its memory tier, lookups and
    gets hit or missed, puts refused, evictions and spills (by label)."""
    url = mesh.metrics_endpoints().get("kvstore")
    if url is None:
        return {}
    page = http_get(url).text  # one read: every figure from the same moment
    out = {"memory_blocks": sample_sum(page, "yinian:kvstore_memory_blocks")}
    for name, label, values in (
        ("lookup_blocks_total", "result", ("hit", "miss")),
        ("get_blocks_total", "result", ("hit", "miss")),
        ("bytes_total", "direction", ("in", "out")),
    ):
        for value in values:
            out[f"{name}_{value}"] = sample_sum(page, f"yinian:kvstore_{name}",
                                                f'{label}="{value}"')  # fmt: skip
    for name in ("rejected_puts_total", "evictions_total", "spilled_blocks_total"):
        out[name] = sample_sum(page, f"yinian:kvstore_{name}")
    return out


def run_workload(folder, model: str, w: Workload, engine_argv_of, out_dir: Path,
                 runs: list[str] = ("off", "on"), earlier: dict | None = None,
                 kvstore_argv: list[str] = ()) -> dict:  # fmt: skip
    """The runs named in `runs`; `earlier`: the `yinian bench serve` result of the other
    run of the same workload, made by an earlier call (one call may not have time for
    both), whose figures and texts stand in for that run's (its tiers are not known)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results, texts = {}, {}
    if earlier is not None:
        other = "on" if "off" in runs else "off"
        texts[other] = earlier["generated_texts"]
        results[other] = {k: earlier.get(k) for k in SUMMARY} | {"from_earlier_call": True}
    for name, store in (("off", False), ("on", True)):
        if name not in runs:
            continue
        spec = MeshSpec(model=str(folder), workers=w.workers, port=0, kvstore=store,
                        engine_argv=engine_argv_of(store),
                        worker_argv=["--kv-write-through", "all"] if store else [],
                        kvstore_argv=list(kvstore_argv))  # fmt: skip
        mesh = Mesh(spec).start(timeout=1800)
        try:
            sampler = _Sampler(lambda mesh=mesh: list(worker_metric(mesh, FRAGMENTATION).values()))
            # the host-tier blocks the scheduler's index knows, all workers together: a
            # dip is an index that forgot a worker (a lost event batch) until its resync
            indexed = _Sampler(
                lambda mesh=mesh: [scheduler_metric(mesh, "yinian:kv_index_blocks", 'tier="host"')]
            )
            result = _serve(mesh, folder, model, w, out_dir, name)
            fragmentation = sampler.stop()
            index_host = indexed.stop()
            tiers = _tiers(mesh) | {"index_host_blocks": index_host}
        finally:
            mesh.stop()
        texts[name] = result["generated_texts"]
        results[name] = {k: result.get(k) for k in SUMMARY} | tiers | {
            "fragmentation": fragmentation, "rc": result["rc"]}  # fmt: skip
    results["workload"] = dataclasses.asdict(w)
    if len(texts) == 2:
        differ = [i for i, (a, b) in enumerate(zip(texts["off"], texts["on"])) if a != b]
        results["outputs_equal"] = not differ and len(texts["off"]) == len(texts["on"])
        results["outputs_differing"] = differ[:20]
    else:  # one run of the two: its texts, for the other run's call to compare
        results["texts"] = texts
    return results
