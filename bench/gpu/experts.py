"""MoE expert services: EPLB on skewed load, replayed and live, and (GPU)
throughput with the experts in separate processes against colocated.

- eplb_replay: per-layer Zipf load matrices of real model shapes (each layer's
  hot experts shuffled), placed over expert services contiguously with no
  spare slot ("without") and by EPLB with 12.5 % redundant slots ("with");
  max/mean tokens per service, per layer.
- live_skew: a mesh whose router is skewed (`--router-skew`: a Zipf-shaped bias
  on the router logits) serving streams on expert services; max/mean tokens
  per service measured by the balancer from the services' reports, under the
  placement made without load information, then after an EPLB rebalance on the
  load just gathered (12.5 % redundant slots); the gathered per-layer load
  matrix is replayed through both placements too.
- throughput, throughput_2 (CUDA): output tokens/s at 64 streams and at one of
  qwen3-30b-a3b (deepseek-v2-lite on a card under 120 GiB; dummy weights) with the
  experts colocated and on 4 (2) expert services, each mesh's start-up, and how
  many greedy texts of 16 streams agree (where one leaves the other: the token,
  whether it took the colocated run's runner-up, and the logprob gap).
- throughput_stream (CUDA): `throughput` over the stream-ordered path
  (`--expert-transport stream`) instead of the mailboxes.
- colocated_eager (CUDA): the colocated worker with --enforce-eager (a worker on
  expert services runs its steps eagerly: its dispatches are not graph-safe).

Usage: python -m bench.gpu.experts --out bench/results/experts.json [--device cpu [--full]]
Sections: eplb_replay, live_skew, throughput.
"""

from __future__ import annotations

import functools
import time

import torch

from bench.gpu.pd_kill import compare, run_streams
from bench.gpu.sections import Sections, script_parser
from engine.make_model import preset_config, write_model
from proto.yinian.v1 import expert_pb2, expert_pb2_grpc
from services.common.tls import sync_channel
from services.expert_parallel.eplb import imbalance, rebalance_experts
from yinian.mesh import Mesh, MeshSpec

# (name, MoE layers, experts, services): Qwen3-30B-A3B over 8, DeepSeek-V3 over 32.
SHAPES = [("qwen3-30b-a3b", 48, 128, 8), ("deepseek-v3", 58, 256, 32)]
DRY_SHAPES = [("small", 4, 32, 4)]
SKEW = 1.2  # Zipf exponent: the hottest expert of a layer gets ~rank^-1.2 of the load
# Both meshes' workers: batches of the streams run, no more (fewer shapes to warm up).
LIMITS = ["--max-num-seqs", "64", "--max-num-batched-tokens", "2048"]
AGREE = 16  # streams whose greedy texts (with logprobs) are compared across the meshes
REPORTS = 0.5  # s between the services' load reports (0.1 in a dry run)


def zipf_loads(layers: int, experts: int, skew: float, tokens: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** skew
    rows = [shape[torch.randperm(experts, generator=g)] for _ in range(layers)]
    return torch.stack(rows) / shape.sum() * tokens


def contiguous(layers: int, experts: int) -> torch.Tensor:
    """Service g holds experts [g E/G, (g+1) E/G): the placement without EPLB."""
    return torch.arange(experts).expand(layers, experts)


def balance(weight: torch.Tensor, services: int, redundancy: float = 0.125) -> dict:
    layers, experts = weight.shape
    slots = services * -(-int(experts * (1 + redundancy)) // services)
    eplb = rebalance_experts(weight, slots, 1, 1, services).phy2log
    without = imbalance(weight, contiguous(layers, experts), services)
    with_eplb = imbalance(weight, eplb, services)
    return {
        "services": services, "experts": experts, "slots": slots,
        "without_mean": without.mean().item(), "without_worst": without.max().item(),
        "with_mean": with_eplb.mean().item(), "with_worst": with_eplb.max().item(),
    }  # fmt: skip


def eplb_replay(shapes) -> dict:
    out = {}
    for name, layers, experts, services in shapes:
        started = time.monotonic()
        row = balance(zipf_loads(layers, experts, SKEW, 1e6, seed=3), services)
        row["eplb_seconds"] = time.monotonic() - started
        out[name] = row
    return out


def skewed_model(root, experts: int):
    config = preset_config("tiny-moe")
    config.update(num_experts=experts, num_experts_per_tok=4, moe_intermediate_size=16)
    return write_model(root / f"tiny-moe-{experts}", config, seed=1)


def live_skew(root, experts: int, services: int, streams: int, tokens: int,
              reports: float = REPORTS) -> dict:  # fmt: skip
    folder = skewed_model(root, experts)
    redundant = int(experts * 0.125)
    spec = MeshSpec(
        model=str(folder), workers=1, experts=services, port=0,
        engine_argv=["--device", "cpu", "--router-skew", str(SKEW)],
        scheduler_argv=["--expert-redundant-slots", str(redundant)],
        expert_argv=["--slots", str(-(-(experts + redundant) // services)),
                     "--report-interval", str(reports)],
    )  # fmt: skip
    settle = 3 * reports  # the services' last load reports reach the balancer
    prompts = [[(17 * i + 5 * j) % 500 for j in range(8 + i % 13)] for i in range(streams)]
    with Mesh(spec) as mesh:
        stub = expert_pb2_grpc.ExpertBalancerStub(sync_channel(mesh.scheduler_address, None))
        status = lambda: stub.GetExpertStatus(expert_pb2.ExpertStatusRequest())  # noqa: E731
        while len(status().placement.members) < services:
            if status().placement.members:
                stub.Rebalance(expert_pb2.RebalanceRequest())
            time.sleep(0.2)
        stub.Rebalance(expert_pb2.RebalanceRequest())  # a fresh, load-free placement
        run_streams(mesh, folder.name, prompts, tokens)
        time.sleep(settle)
        before = list(status().measured_imbalance)
        window = _window(status())
        reply = stub.Rebalance(expert_pb2.RebalanceRequest())
        run_streams(mesh, folder.name, prompts, tokens)
        time.sleep(settle)
        after = status()
    replay = balance(window, services) if window is not None else {}
    return {
        "experts": experts, "services": services, "slots": (experts + redundant),
        "measured_without": before, "measured_with": list(after.measured_imbalance),
        "predicted_before": list(reply.imbalance_before),
        "predicted_after": list(reply.imbalance_after),
        "window_tokens": reply.window_tokens, "replay": replay,
        "mean_without": sum(before) / max(1, len(before)),
        "mean_with": sum(after.measured_imbalance) / max(1, len(after.measured_imbalance)),
    }  # fmt: skip


def _window(status: expert_pb2.ExpertStatus) -> torch.Tensor | None:
    """The load the balancer gathered, [MoE layers, experts] (what EPLB balances)."""
    placement = status.placement
    if not status.window_load:
        return None
    return torch.tensor(list(status.window_load)).view(placement.num_moe_layers, -1)


def _worker_counters(mesh) -> dict:
    """The expert counters: pairs the worker computed remote and local, its fallbacks,
    the placement version it routes by, and seconds (with counts) of its dispatches,
    its combines' waits and the services' computing."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    keys = {"yinian:expert_dispatch_seconds": "dispatch",
            "yinian:expert_combine_wait_seconds": "combine_wait",
            "yinian:expert_service_compute_seconds": "service_compute"}  # fmt: skip
    out = {"remote": 0.0, "local": 0.0, "fallbacks": 0.0, "version": 0.0}
    for name, url in mesh.metrics_endpoints().items():
        if not name.startswith(("worker", "expert")):
            continue
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "yinian:expert_tokens_dispatched_total":
                    out[sample.labels["where"]] += sample.value
                elif sample.name == "yinian:expert_fallbacks_total":
                    out["fallbacks"] += sample.value
                elif sample.name == "yinian:expert_placement_version":
                    out["version"] = sample.value
                elif sample.name.removesuffix("_sum") in keys and sample.name.endswith("_sum"):
                    key = keys[sample.name.removesuffix("_sum")] + "_s"
                    out[key] = out.get(key, 0.0) + sample.value
                elif sample.name.removesuffix("_count") in keys and sample.name.endswith("_count"):
                    key = keys[sample.name.removesuffix("_count")] + "_n"
                    out[key] = out.get(key, 0.0) + sample.value
    return out


def _await_placement(mesh, services: int, poke, timeout: float = 300) -> float:
    """Seconds until the balancer's placement spans `services` services and the
    worker routes by it (it takes a new placement at a step: `poke` makes one)."""
    stub = expert_pb2_grpc.ExpertBalancerStub(sync_channel(mesh.scheduler_address, None))
    began, deadline = time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        placement = stub.GetExpertStatus(expert_pb2.ExpertStatusRequest()).placement
        if (len(placement.members) == services
                and _worker_counters(mesh)["version"] >= placement.version > 0):  # fmt: skip
            return time.monotonic() - began
        poke()
        time.sleep(0.2)
    raise TimeoutError(f"no placement over {services} expert services in {timeout} s")


def _preset_for(device: str, preset: str | None) -> str:
    """qwen3-30b-a3b where its worker and the services' slots fit the GPU (the worker
    keeps every expert, for a failed dispatch: 58 GB, and the services ~65 GB more),
    deepseek-v2-lite (31 GB) on a smaller card."""
    if preset is not None:
        return preset
    if device != "cuda":
        return "tiny-moe"
    return "qwen3-30b-a3b" if torch.cuda.mem_get_info()[1] > 120 * 2**30 else "deepseek-v2-lite"


def throughput(streams: int, tokens: int, experts: int, preset: str | None = None,
               device: str = "cuda", eager: bool = False,
               transport: str = "auto") -> dict:  # fmt: skip
    """Colocated vs expert services (the worker's default transport: mailboxes over
    CUDA IPC on one GPU): output tokens/s at `streams` streams and at one, each
    mesh's start-up, and whether the greedy texts agree. On the CPU (a tiny preset)
    it checks the plumbing only."""
    import tempfile
    from pathlib import Path

    from basis.model_config import ModelConfig
    from bench.gpu.models import preset_folder

    preset = _preset_for(device, preset)
    root = Path(tempfile.mkdtemp(prefix="experts-"))
    folder, _ = preset_folder(root, preset)
    routed = ModelConfig.from_pretrained(str(folder)).num_experts
    prompts = [[(31 * i + j) % 1000 for j in range(128)] for i in range(streams)]
    dtype = ["--dtype", "bfloat16"] if device == "cuda" else []
    out: dict = {"preset": preset, "streams": streams, "tokens": tokens, "services": experts,
                 "transport": transport}  # fmt: skip
    # Each service holds its share of a layer's experts and 12.5 % spare slots (the
    # balancer's redundant replicas), not all of them. The worker keeps every expert
    # too (it computes a failed dispatch), so beside the services it leaves them half.
    slots = -(-routed * 9 // 8 // max(1, experts))
    texts = {}
    configs = [("colocated", 0), ("expert_services", experts)] if experts else [("colocated", 0)]
    for name, count in configs:
        memory = ["--gpu-memory-utilization", "0.5"] if count and device == "cuda" else []
        memory += ["--enforce-eager"] if eager else []
        spec = MeshSpec(
            model=str(folder), workers=1, experts=count, port=0,
            engine_argv=["--load-format", "dummy", "--device", device, *dtype, *memory,
                         *LIMITS],
            expert_argv=["--device", device, "--load-format", "dummy", *dtype,
                         "--slots", str(slots)],
            scheduler_argv=["--expert-redundant-slots", str(max(0, slots * experts - routed))],
            worker_argv=["--expert-transport", transport],
        )  # fmt: skip
        began = time.monotonic()
        mesh = Mesh(spec).start(timeout=1800)
        row: dict = {"start_s": time.monotonic() - began}
        try:
            if count:
                poke = functools.partial(run_streams, mesh, folder.name, prompts[:1], 2)
                row["placement_s"] = _await_placement(mesh, count, poke)
            run_streams(mesh, folder.name, prompts[:2], 4)  # the first requests' one-off costs
            before = _worker_counters(mesh) if count else {}
            for label, batch in (("batch", prompts), ("single", prompts[:1])):
                started = time.monotonic()
                results, _, _ = run_streams(mesh, folder.name, batch, tokens)
                elapsed = time.monotonic() - started
                done = sum(r["error"] is None for r in results)
                row[f"{label}_output_tok_s"] = done * tokens / elapsed
                row[f"{label}_failed"] = len(results) - done
            # greedy agreement, with the top-2 logprobs: where a text leaves the colocated
            # one, whether the other took the runner-up and by what margin (a near-tie)
            texts[name], _, _ = run_streams(mesh, folder.name, prompts[:AGREE], tokens,
                                            logprobs=2)  # fmt: skip
            if count:
                after = _worker_counters(mesh)  # the measured runs' pairs, remote and local
                row["counters"] = {k: v - before.get(k, 0.0) for k, v in after.items()
                                   if k != "version"}  # fmt: skip
        finally:
            mesh.stop()
        out[name] = row
        print(f"{name}: {row}", flush=True)
    if len(texts) == 2:
        rows = [compare(c, s) for c, s in zip(texts["colocated"], texts["expert_services"])]
        out["agreement"] = rows
        out["equal_texts"] = sum(r["equal"] for r in rows)
        out["compared"] = len(rows)
        out["left_at_a_near_tie"] = sum(r.get("runner_up", False) for r in rows)
    for label in ("batch", "single") if experts else ():
        key = f"{label}_output_tok_s"
        out[f"{label}_ratio"] = out["expert_services"][key] / out["colocated"][key]
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument(
        "--full",
        action="store_true",
        help="on the cpu: live_skew at full size (32 experts, 4 services)",
    )
    args = parser.parse_args(argv)
    dry = args.device == "cpu" and not args.full
    with Sections(args, script="experts") as section:
        section("eplb_replay", lambda: eplb_replay(DRY_SHAPES if dry else SHAPES))
        section("live_skew", lambda: live_skew(section.tmp, 16 if dry else 32, 2 if dry else 4,
                                               8 if dry else 32, 6 if dry else 32,
                                               0.1 if dry else REPORTS))  # fmt: skip
        section("throughput", lambda: throughput(64, 128, 4), needs="CUDA")
        section("throughput_2", lambda: throughput(64, 128, 2), needs="CUDA")
        section("throughput_stream", lambda: throughput(64, 128, 4, transport="stream"),
                needs="CUDA")  # fmt: skip
        # the colocated worker without CUDA graphs (as a worker on expert services runs)
        section("colocated_eager", lambda: throughput(64, 128, 0, eager=True), needs="CUDA")
        for name, row in (section.results.get("eplb_replay") or {}).items():
            if "with_mean" in row:
                print(f"{name}: max/mean without {row['without_mean']:.2f} "
                      f"(worst {row['without_worst']:.2f}), with EPLB {row['with_mean']:.2f} "
                      f"(worst {row['with_worst']:.2f}) on {row['slots']} slots")  # fmt: skip
        return section.results


if __name__ == "__main__":
    main()
