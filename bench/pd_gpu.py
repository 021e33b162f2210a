"""Prefill/decode disaggregation on one GPU: a prefill worker and a decode
worker as two processes sharing the device, KV over cuda_ipc.

Records, with the ceilings of the same run: the KV transfer bandwidth for
>= 64 MB against the device-to-device copy rate; greedy outputs of the split
path equal to the decode worker prefilling locally (another tenant, so no
shared cache); and the time to first token of 1k, 8k and 32k prompts on the
llama3-8b preset broken into queue, prefill, transfer and first decode step,
with the transfer's share.

Usage: python -m bench.pd_gpu --out DIR  (needs nats-server on PATH)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import grpc
import torch

from bench.ceilings import measure
from engine.make_model import preset_config, write_model
from proto.yinian.v1 import (
    common_pb2,
    scheduler_pb2,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.processes import free_port
from yinian.mesh import Mesh, MeshSpec
from yinian.mesh_probe import workers_by_role

LENGTHS = (1024, 8192, 32768)
VOCAB = 500  # prompt ids below every preset's vocabulary


def workers(mesh: Mesh) -> dict[str, scheduler_pb2.WorkerInfo]:
    """role -> the first listed worker of that role."""
    return {role: infos[0] for role, infos in workers_by_role(mesh).items()}


def generate(
    stub,
    request_id: str,
    prompt: list[int],
    tenant: str,
    prefill_address: str = "",
    max_tokens: int = 8,
    logprobs: int | None = None,
) -> dict:
    params = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    if logprobs is not None:
        params.logprobs = logprobs
    request = worker_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        params=params,
        tenant=tenant,
        prefill_address=prefill_address,
    )
    start = time.perf_counter()
    ttft, tokens, timings, tops = None, [], None, []
    for chunk in stub.Generate(request, timeout=600):
        if chunk.error:
            raise RuntimeError(chunk.error)
        if chunk.token_ids and ttft is None:
            ttft = time.perf_counter() - start
        tokens += list(chunk.token_ids)
        tops += [{t.token_id: t.logprob for t in p.top} for p in chunk.logprobs]
        if chunk.HasField("timings"):
            timings = chunk.timings
    return {"ttft_s": ttft, "tokens": tokens, "timings": timings, "top_logprobs": tops}


def ttft_breakdown(decode_stub, prefill_address: str, length: int, runs: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(runs + 1):  # the first run warms this length up
        prompt = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        out = generate(decode_stub, f"pd-{length}-{i}", prompt, "pd", prefill_address)
        t = out["timings"]
        rows.append(
            {
                "ttft_s": out["ttft_s"],
                "queue_s": t.queue_seconds,
                "prefill_s": t.prefill_seconds,
                "transfer_s": t.transfer_seconds,
                "first_decode_s": t.first_decode_seconds,
                "bytes": t.transfer_bytes,
                "blocks": t.transfer_blocks,
                "transport": t.transport,
            }
        )
    measured = rows[1:]

    def med(key):
        return statistics.median(r[key] for r in measured)

    result = {
        k: med(k)
        for k in (
            "ttft_s",
            "queue_s",
            "prefill_s",
            "transfer_s",
            "first_decode_s",
            "bytes",
            "blocks",
        )
    }
    result.update(
        length=length,
        runs=measured,
        transport=measured[0]["transport"],
        transfer_share_of_ttft=result["transfer_s"] / result["ttft_s"],
    )
    return result


def equality(decode_stub, prefill_address: str, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, length in enumerate((1, 200, 1500, 3000)):
        prompt = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        split = generate(decode_stub, f"eq-pd-{i}", prompt, "split", prefill_address, 24, 5)
        local = generate(decode_stub, f"eq-local-{i}", prompt, "local", "", 24, 5)
        diverged = next(
            (j for j, (a, b) in enumerate(zip(split["tokens"], local["tokens"])) if a != b), None
        )
        gap = None
        if diverged is not None:  # the two candidates under the local run's logprobs
            top = local["top_logprobs"][diverged] if diverged < len(local["top_logprobs"]) else {}
            a, b = local["tokens"][diverged], split["tokens"][diverged]
            gap = abs(top[a] - top[b]) if a in top and b in top else None
        out.append(
            {
                "length": length,
                "equal": split["tokens"] == local["tokens"],
                "diverged_at": diverged,
                "logprob_gap": gap,
                "split": split["tokens"],
                "local": local["tokens"],
                "transport": split["timings"].transport,
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--device", default="cuda")  # cpu: a dry run of the script itself
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    args = parser.parse_args()
    cuda = args.device == "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    no_gpu = {"copy_gbps": 1.0, "matmul_bf16_tflops": 1.0}
    results: dict = {"ceilings": measure() if cuda else no_gpu}

    def save():
        (out / "pd.json").write_text(json.dumps(results, indent=2, default=str))

    try:
        if not cuda:
            raise RuntimeError("skipped: no GPU")
        from bench.kv_transfer_gpu import run as transfer_run

        results["transfer"] = transfer_run(results["ceilings"])
    except Exception:
        results["transfer"] = {"error": traceback.format_exc()}
        print(results["transfer"]["error"], flush=True)
    save()
    folder = write_model(
        Path(tempfile.mkdtemp()) / args.preset, preset_config(args.preset), weights=False
    )
    engine = [
        "--device",
        args.device,
        "--load-format",
        "dummy",
        "--max-num-batched-tokens",
        "8192",
        "--max-num-seqs",
        "64",
    ]
    if cuda:
        engine += ["--dtype", "bfloat16", "--max-model-len", "40960"]
    spec = MeshSpec(
        model=str(folder),
        workers=0,
        prefill=1,
        decode=1,
        port=free_port(),
        engine_argv=engine,
        scheduler_argv=["--disagg-min-tokens", "1"],
        worker_argv=["--kv-transports", "cuda_ipc,tcp" if cuda else "tcp"],
        role_argv={
            "prefill": ["--num-gpu-blocks", "12000"],
            "decode": ["--num-gpu-blocks", "16000"],
        },
    )
    mesh = Mesh(spec).start(timeout=900)
    try:
        roles = workers(mesh)
        decode = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(roles["decode"].address))
        prefill_address = roles["prefill"].address
        try:
            results["equality"] = equality(decode, prefill_address, seed=1)
        except Exception:
            results["equality"] = {"error": traceback.format_exc()}
        save()
        results["ttft"] = []
        for length in map(int, args.lengths.split(",")):
            try:
                results["ttft"].append(
                    ttft_breakdown(decode, prefill_address, length, args.runs, seed=length)
                )
            except Exception:
                results["ttft"].append({"length": length, "error": traceback.format_exc()})
            save()
    finally:
        mesh.stop()
    print_table(results)


def print_table(results: dict) -> None:
    c = results["ceilings"]
    print(
        f"\nceilings: copy {c['copy_gbps']:.0f} GB/s, bf16 matmul "
        f"{c['matmul_bf16_tflops']:.0f} TFLOP/s"
    )
    t = results.get("transfer", {})
    print("transfer:", json.dumps({k: v for k, v in t.items() if k != "runs"}, default=str)[:600])
    for e in results.get("equality", []) if isinstance(results.get("equality"), list) else []:
        print(f"equal split vs local, {e['length']} tokens ({e['transport']}): {e['equal']}")
    print(
        "| prompt | TTFT ms | queue | prefill | transfer | first decode | transfer share "
        "| MB | GB/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results.get("ttft", []):
        if "error" in r:
            print(f"| {r['length']} | error |")
            continue
        gbps = r["bytes"] / r["transfer_s"] / 1e9 if r["transfer_s"] else 0
        print(
            f"| {r['length']} | {r['ttft_s'] * 1e3:.1f} | {r['queue_s'] * 1e3:.1f} | "
            f"{r['prefill_s'] * 1e3:.1f} | {r['transfer_s'] * 1e3:.1f} | "
            f"{r['first_decode_s'] * 1e3:.1f} | {r['transfer_share_of_ttft']:.1%} | "
            f"{r['bytes'] / 1e6:.0f} | {gbps:.0f} |"
        )


if __name__ == "__main__":
    main()
