"""Prefill/decode disaggregation across two GPUs of one host, KV over nccl.

A prefill worker on GPU 0 and two decode workers on GPU 1 (each process sees
both GPUs, its own first: CUDA_VISIBLE_DEVICES "0,1" or "1,0", so NCCL can
use the peer path), every worker offering only nccl and tcp. Records, with the
ceilings of the same run (copy and matmul on GPU 0, a torch peer copy
GPU 0 -> GPU 1):
1. the nccl transfer rate for 64, 512 and 2048 blocks (134 MB to 4.3 GB) of a
   llama3-8b KV layout, against the peer copy rate;
2. greedy outputs of the split path equal to the decode worker running the
   same prompt alone on its GPU (the single-GPU colocated run);
3. TTFT of 1k, 8k and 32k prompts broken into queue, prefill, transfer and
   first decode step, with the transfer's share;
4. the kill test: 32 streams through the gateway, decode-0 (GPU 1) SIGKILLed
   once 8 have tokens; each stream is set beside a clean run of the same
   prompts (equal, or where it parts and by what logprob gap), none may hang,
   and the prefill worker's leased blocks must come back.

Usage: python -m bench.pd_nccl_gpu --out DIR  (needs nats-server on PATH)
--device cpu runs the same steps on CPU (tcp) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import grpc
import torch

from bench import pd_kill
from bench.pd_gpu import LENGTHS, VOCAB, equality, ttft_breakdown
from bench.sections import Sections
from engine.make_model import preset_config, write_model
from proto.yinian.v1 import worker_pb2_grpc
from services.common.processes import free_port
from yinian.mesh import Mesh, MeshSpec
from yinian.mesh_probe import gateway_metric, metric_sum, workers_by_role

NO_MULTICAST = {  # NVLink multicast stays off on shared hosts
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def ceilings(cuda: bool) -> dict:
    if not cuda:
        return {"copy_gbps": 1.0, "matmul_bf16_tflops": 1.0, "peer_copy_gbps": 1.0}
    from bench.ceilings import measure, peer_copy_bandwidth
    from bench.nccl_ceiling import measure as nccl_p2p

    return measure() | {
        "gpus": torch.cuda.device_count(),
        "peer_copy_gbps": peer_copy_bandwidth(0, 1),
        "peer_copy_gbps_1_to_0": peer_copy_bandwidth(1, 0),
        "nccl_send_recv_gbps": nccl_p2p(),  # {message MB: GB/s}, no transport around it
    }


def mesh_spec(folder: Path, device: str, blocks: tuple[int, int], dtype: str = "") -> MeshSpec:
    engine = ["--device", device, "--load-format", "dummy", "--max-num-batched-tokens", "8192"]
    engine += ["--max-num-seqs", "64"]
    if dtype:
        engine += ["--dtype", dtype]
    elif device == "cuda":
        engine += ["--dtype", "bfloat16", "--max-model-len", "40960"]
    return MeshSpec(
        model=str(folder),
        workers=0,
        prefill=1,
        decode=2,
        port=free_port(),
        env=NO_MULTICAST,
        engine_argv=engine,
        scheduler_argv=["--disagg-min-tokens", "1", "--heartbeat-timeout", "2"],
        worker_argv=["--kv-transports", "nccl,tcp"],
        role_argv={
            "prefill": ["--num-gpu-blocks", str(blocks[0])],
            "decode": ["--num-gpu-blocks", str(blocks[1]), "--kv-lease-seconds", "5"],
        },
        role_env={
            "prefill": {"CUDA_VISIBLE_DEVICES": "0,1"},
            "decode": {"CUDA_VISIBLE_DEVICES": "1,0"},
        }
        if device == "cuda"
        else {},
    )


def kill_test(mesh: Mesh, model: str, streams: int, max_tokens: int) -> dict:
    g = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(0, VOCAB, (200 + 50 * i,), generator=g).tolist() for i in range(streams)
    ]
    clean, _, clean_hung = pd_kill.run_streams(mesh, model, prompts, max_tokens, logprobs=2)
    t0 = time.monotonic()
    killed, elapsed, hung = pd_kill.run_streams(
        mesh, model, prompts, max_tokens, kill="decode-0", wait_started=max(1, streams // 4)
    )
    rows = [pd_kill.compare(c, k) for c, k in zip(clean, killed)]
    leases_freed_s = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if metric_sum(mesh, "yinian:kv_cache_usage_ratio", role="prefill") == 0:
            leases_freed_s = time.monotonic() - t0
            break
        time.sleep(0.5)
    return {
        "streams": streams,
        "max_tokens": max_tokens,
        "clean_errors": [c["error"] for c in clean if c["error"]],
        "clean_hung": clean_hung,
        "equal": sum(r["equal"] for r in rows),
        "errors": [r["error"] for r in rows if "error" in r],
        "diverged": [dict(r, stream=i) for i, r in enumerate(rows) if not r["equal"]],
        "hung": hung,
        "seconds_after_kill": elapsed,
        "stream_end_s": [round(r["end_s"], 3) for r in killed],
        "prefill_blocks_released": leases_freed_s is not None,
        "prefill_usage_zero_after_s": leases_freed_s,
        "migrations": gateway_metric(mesh, "yinian:request_migrations_total"),
    }


def mesh_steps(args, step) -> None:
    """Equality, TTFT and the kill test on the llama3-8b (or --preset) mesh."""
    folder = write_model(
        Path(tempfile.mkdtemp()) / args.preset, preset_config(args.preset), weights=False
    )
    blocks = tuple(int(b) for b in args.blocks.split(","))
    mesh = Mesh(mesh_spec(folder, args.device, blocks)).start(timeout=900)
    try:
        roles = workers_by_role(mesh)
        decode0 = next(w for w in roles["decode"] if w.worker_id == "decode-0")
        decode = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(decode0.address))
        prefill = roles["prefill"][0].address
        step("equality", lambda: equality(decode, prefill, seed=1))
        lengths = [int(n) for n in args.lengths.split(",")]
        runs = args.runs
        step("ttft", lambda: [ttft_breakdown(decode, prefill, n, runs, n) for n in lengths])
        step("kill", lambda: kill_test(mesh, args.preset, args.streams, args.max_tokens))
    finally:
        mesh.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--blocks", default="12000,6000", help="prefill,decode KV blocks")
    parser.add_argument("--skip", nargs="*", default=[], help="steps to skip")
    args = parser.parse_args()
    os.environ.update(NO_MULTICAST)
    cuda = args.device == "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"ceilings": ceilings(cuda)}

    step = Sections(results, out / "pd_nccl.json", args.skip)

    if cuda:
        from bench.kv_transfer_gpu import run_nccl

        step("transfer", lambda: run_nccl(results["ceilings"]["peer_copy_gbps"]))
    if {"equality", "ttft", "kill"} - set(args.skip):
        mesh_steps(args, step)
    # The CPU test's kill run (tiny-llama, float32, 300 tokens), decode workers on GPU 1.
    if "kill_tiny" not in args.skip:
        tiny = write_model(
            Path(tempfile.mkdtemp()) / "tiny-llama", preset_config("tiny-llama"), weights=False
        )
        mesh = Mesh(mesh_spec(tiny, args.device, (4000, 4000), "float32")).start(timeout=600)
        try:
            step("kill_tiny", lambda: kill_test(mesh, "tiny-llama", args.streams, 300))
        finally:
            mesh.stop()
    step.save()
    print_table(results)


def print_table(results: dict) -> None:
    c = results["ceilings"]
    print(
        f"\nceilings: copy {c['copy_gbps']:.0f} GB/s (r+w), matmul {c['matmul_bf16_tflops']:.0f} "
        f"TFLOP/s, peer copy GPU0->GPU1 {c['peer_copy_gbps']:.0f} GB/s, NCCL send/recv "
        f"{c.get('nccl_send_recv_gbps')} GB/s by message MB"
    )
    for r in results.get("transfer", []) if isinstance(results.get("transfer"), list) else []:
        print(
            f"nccl {r['plan']}: {r['bytes_moved'] / 1e6:.0f} MB in {r['ms']:.2f} ms = "
            f"{r['moved_gbps']:.0f} GB/s, {r['fraction_of_peer_copy']:.2f} of peer copy, "
            f"exact={r['exact']}"
        )
    eq = results.get("equality")
    for e in eq if isinstance(eq, list) else []:
        print(
            f"split == colocated, {e['length']} tokens ({e['transport']}): {e['equal']}"
            + ("" if e["equal"] else f" (diverged at {e['diverged_at']}, gap {e['logprob_gap']})")
        )
    print("| prompt | TTFT ms | queue | prefill | transfer | first decode | share | transport |")
    print("|---|---|---|---|---|---|---|---|")
    ttft = results.get("ttft")
    for r in ttft if isinstance(ttft, list) else []:
        print(
            f"| {r['length']} | {r['ttft_s'] * 1e3:.1f} | {r['queue_s'] * 1e3:.1f} | "
            f"{r['prefill_s'] * 1e3:.1f} | {r['transfer_s'] * 1e3:.1f} | "
            f"{r['first_decode_s'] * 1e3:.1f} | {r['transfer_share_of_ttft']:.1%} | "
            f"{r['transport']} |"
        )
    for name in ("kill", "kill_tiny"):
        print_kill(name, results.get(name, {}))
    for name in ("transfer", "equality", "ttft", "kill", "kill_tiny"):
        if isinstance(results.get(name), dict) and "error" in results[name]:
            print(f"{name}: ERROR {results[name]['error'][-400:]}")


def print_kill(name: str, k: dict) -> None:
    if "equal" in k:
        print(
            f"{name}: {k['equal']}/{k['streams']} equal to the clean run, "
            f"{len(k['errors'])} errors, hung={k['hung']}, "
            f"{k['seconds_after_kill']:.1f} s after the kill, "
            f"prefill blocks released={k['prefill_blocks_released']}"
        )
        for d in k["diverged"]:
            print("  diverged:", json.dumps(d))


if __name__ == "__main__":
    main()
