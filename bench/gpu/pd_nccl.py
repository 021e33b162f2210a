"""Prefill/decode disaggregation across two GPUs of one host, KV over nccl.

A prefill worker on GPU 0 and two decode workers on GPU 1 (each process sees
both GPUs, its own first: CUDA_VISIBLE_DEVICES "0,1" or "1,0", so NCCL can
use the peer path), every worker offering only nccl and tcp. Records, with the
ceilings of the same run (copy and matmul on GPU 0; a torch peer copy
GPU 0 -> GPU 1 and NCCL send/recv alone):
1. the nccl transfer rate for 64, 512 and 2048 blocks (134 MB to 4.3 GB) of a
   llama3-8b KV layout, against the peer copy rate (`kv_transfer`);
2. greedy outputs of the split path equal to the decode worker running the
   same prompt alone on its GPU (the single-GPU colocated run; `pd_mesh`);
3. TTFT of 1k, 8k and 32k prompts broken into queue, prefill, transfer and
   first decode step, with the transfer's share (`pd_mesh`);
4. the kill test (`pd_kill`): 32 streams through the gateway, decode-0 (GPU 1)
   SIGKILLed once 8 have tokens, on llama3-8b and on tiny-llama in float32 (the
   CPU test's run, where the migration itself must lose and repeat nothing).

Usage: python -m bench.gpu.pd_nccl --out bench/results/pd_nccl.json
           [--preset NAME] [--streams N] [--max-tokens N]  (needs nats-server on PATH)
Sections: ceilings, peer_ceilings, transfer_nccl, equality, ttft, kill, kill_tiny.
The dry run (`--device cpu`) runs the meshes on tiny-llama with KV over tcp.
"""

from __future__ import annotations

import os
from pathlib import Path

from bench.gpu import ceilings, kv_transfer, pd_kill, pd_mesh
from bench.gpu.models import preset_folder
from bench.gpu.sections import Sections, script_parser
from yinian.mesh import Mesh, MeshSpec

NO_MULTICAST = {  # NVLink multicast stays off on shared hosts
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# (streams, new tokens) of the kill test on the main mesh
KILLS = {"cuda": (32, 256), "cpu": (4, 24)}


def mesh_spec(folder: Path, device: str, blocks: tuple[int, int], dtype: str = "") -> MeshSpec:
    return pd_mesh.split_spec(
        folder,
        device,
        2,
        "nccl,tcp",
        blocks,
        dtype,
        scheduler_argv=["--heartbeat-timeout", "2"],
        decode_argv=["--kv-lease-seconds", "5"],
        env=NO_MULTICAST,
        role_env={
            "prefill": {"CUDA_VISIBLE_DEVICES": "0,1"},
            "decode": {"CUDA_VISIBLE_DEVICES": "1,0"},
        }
        if device == "cuda"
        else {},
    )


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--runs", type=int)
    parser.add_argument("--preset")
    parser.add_argument("--lengths", help="TTFT prompt lengths, comma-separated")
    parser.add_argument("--streams", type=int)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--blocks", default="12000,6000", help="prefill,decode KV blocks")
    args = parser.parse_args(argv)
    os.environ.update(NO_MULTICAST)
    cuda = args.device == "cuda"
    lengths, equal_lengths, runs = pd_mesh.GPU_PROMPTS if cuda else pd_mesh.DRY_PROMPTS
    lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else lengths
    runs = args.runs or runs
    preset = args.preset or ("llama3-8b" if cuda else "tiny-llama")
    streams, max_tokens = KILLS[args.device]
    streams, max_tokens = args.streams or streams, args.max_tokens or max_tokens
    blocks = tuple(int(b) for b in args.blocks.split(",")) if cuda else (1000, 1000)
    with Sections(args, script="pd_nccl", preset=preset) as section:
        section("ceilings", lambda: ceilings.measure(section.device))
        nccl = "NCCL between two GPUs"
        peer = section("peer_ceilings", ceilings.peer_ceilings, needs=nccl, gpus=2) or {}
        section("transfer_nccl", lambda: kv_transfer.run_nccl(peer["peer_copy_gbps"]),
                needs=nccl, gpus=2)  # fmt: skip

        def start(name: str, dtype: str, blocks: tuple[int, int]):
            folder, _ = preset_folder(section.tmp, name)
            spec = mesh_spec(folder, section.device, blocks, dtype)
            return lambda: Mesh(spec).start(timeout=900)

        mesh = section.resource(start(preset, "" if cuda else "float32", blocks), Mesh.stop)

        def endpoints():
            return pd_mesh.endpoints(mesh(), "decode-0")

        section("equality", lambda: pd_mesh.equality(*endpoints(), equal_lengths))
        section("ttft", lambda: [pd_mesh.ttft_breakdown(*endpoints(), n, runs, n)
                                 for n in lengths])  # fmt: skip
        section("kill", lambda: pd_kill.kill_test(mesh(), preset, streams, max_tokens))
        mesh.close()
        # The CPU test's kill run (tiny-llama, float32), decode workers on GPU 1. In a dry
        # run the mesh above is this one already, and `kill` was its kill test.
        tiny = section.resource(start("tiny-llama", "float32", (4000, 4000)), Mesh.stop)
        section(
            "kill_tiny",
            lambda: pd_kill.kill_test(tiny(), "tiny-llama", streams, 300),
            needs="a GPU (on the cpu `kill` ran this same tiny-llama float32 mesh)",
        )
        tiny.close()
        print_table(section.results)
        return section.results


def print_table(results: dict) -> None:
    c, p = results.get("ceilings") or {}, results.get("peer_ceilings") or {}
    if "copy_gbps" in c:
        print(f"\nceilings: copy {c['copy_gbps']:.0f} GB/s (r+w), matmul "
              f"{c['matmul_bf16_tflops']:.0f} TFLOP/s; peer copy GPU0->GPU1 "
              f"{p.get('peer_copy_gbps')} GB/s, NCCL send/recv "
              f"{p.get('nccl_send_recv_gbps')} GB/s by message MB")  # fmt: skip
    rows = results.get("transfer_nccl")
    for r in rows if isinstance(rows, list) else []:
        print(f"nccl {r['plan']}: {r['bytes_moved'] / 1e6:.0f} MB in {r['ms']:.2f} ms = "
              f"{r['moved_gbps']:.0f} GB/s, {r['fraction_of_peer_copy']:.2f} of peer copy, "
              f"exact={r['exact']}")  # fmt: skip
    pd_mesh.print_results(results)
    for name in ("kill", "kill_tiny"):
        k = results.get(name) or {}
        if "equal" in k:
            print(f"{name}: {k['equal']}/{k['streams']} equal to the clean run, "
                  f"{len(k['errors'])} errors, hung={k['hung']}, "
                  f"{k['seconds_after_kill']:.1f} s after the kill, "
                  f"prefill blocks released={k['prefill_blocks_released']}")  # fmt: skip
            for d in k["diverged"]:
                print("  diverged:", d)


if __name__ == "__main__":
    main()
