"""Prefill/decode disaggregation on one GPU: a prefill worker and a decode
worker as two processes sharing the device, KV over cuda_ipc.

Records, with the ceilings of the same run: the KV transfer bandwidth for
>= 64 MB against the device-to-device copy rate (cuda_ipc; tcp for comparison);
greedy outputs of the split path equal to the decode worker prefilling locally;
and the time to first token of 1k, 8k and 32k prompts on the llama3-8b preset
broken into queue, prefill, transfer and first decode step, with the transfer's
share (`pd_mesh`).

Usage: python -m bench.gpu.pd_cuda_ipc --out bench/results/pd_cuda_ipc.json
           [--preset NAME] [--runs N] [--lengths 1024,8192]  (needs nats-server on PATH)
Sections: ceilings, transfer_cuda_ipc, transfer_tcp, equality, ttft. The dry run
(`--device cpu`) runs tiny-llama's mesh with KV over tcp.
"""

from __future__ import annotations

from bench.gpu import ceilings, kv_transfer, pd_mesh
from bench.gpu.sections import Sections, script_parser
from yinian.mesh import Mesh, MeshSpec


def mesh_spec(folder, device: str) -> MeshSpec:
    cuda = device == "cuda"
    blocks = (12000, 16000) if cuda else (1000, 1000)
    return pd_mesh.split_spec(folder, device, 1, "cuda_ipc,tcp" if cuda else "tcp", blocks)


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--runs", type=int)
    parser.add_argument("--preset")
    parser.add_argument("--lengths", help="TTFT prompt lengths, comma-separated")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    lengths, equal_lengths, runs = pd_mesh.GPU_PROMPTS if cuda else pd_mesh.DRY_PROMPTS
    lengths = [int(n) for n in args.lengths.split(",")] if args.lengths else lengths
    runs = args.runs or runs
    preset = args.preset or ("llama3-8b" if cuda else "tiny-llama")
    layout = kv_transfer.LLAMA3_8B if cuda else kv_transfer.DRY
    with Sections(args, script="pd_cuda_ipc", preset=preset) as section:
        ceiling = section("ceilings", lambda: ceilings.measure(section.device)) or {}
        copy = ceiling.get("copy_gbps", 0.0)
        section("transfer_cuda_ipc", lambda: kv_transfer.run_cuda_ipc(copy, layout),
                needs="CUDA IPC")  # fmt: skip
        section("transfer_tcp", lambda: kv_transfer.run_tcp(
            copy, "cuda:0" if cuda else "cpu", layout))  # fmt: skip

        def start() -> Mesh:
            from bench.gpu.models import preset_folder

            folder, _ = preset_folder(section.tmp, preset)
            return Mesh(mesh_spec(folder, section.device)).start(timeout=900)

        mesh = section.resource(start, Mesh.stop)
        section("equality", lambda: pd_mesh.equality(*pd_mesh.endpoints(mesh()), equal_lengths))
        section("ttft", lambda: [pd_mesh.ttft_breakdown(*pd_mesh.endpoints(mesh()), n, runs, n)
                                 for n in lengths])  # fmt: skip
        mesh.close()
        print_table(section.results)
        return section.results


def print_table(results: dict) -> None:
    c = results.get("ceilings") or {}
    if "copy_gbps" in c:
        print(f"\nceilings: copy {c['copy_gbps']:.0f} GB/s, bf16 matmul "
              f"{c['matmul_bf16_tflops']:.0f} TFLOP/s")  # fmt: skip
    for name in ("transfer_cuda_ipc", "transfer_tcp"):
        rows = results.get(name)
        for r in rows if isinstance(rows, list) else []:
            frac = f"{r['fraction_of_copy']:.2f}" if r["fraction_of_copy"] else "-"
            print(f"{r['transport']} {r['plan']}: {r['bytes_moved'] / 2**20:.0f} MB, wall "
                  f"{r['ms']:.2f} ms, GPU {r.get('gpu_ms', 0):.3f} ms, {frac} of copy, "
                  f"exact={r['exact']}")  # fmt: skip
    pd_mesh.print_results(results)


if __name__ == "__main__":
    main()
