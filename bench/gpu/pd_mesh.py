"""The disaggregation experiments' mesh-side measurements, shared by `pd_cuda_ipc` and
`pd_nccl`: greedy outputs of the split path against the decode worker prefilling the
same prompt itself (another tenant, so no shared cache), and the time to first token
of long prompts broken into queue, prefill, transfer and first decode step, with the
transfer's share. Both talk to a decode worker's Generate RPC directly, naming the
prefill worker.
"""

from __future__ import annotations

import statistics
import time

import torch

from proto.yinian.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.tls import sync_channel
from yinian.mesh import MeshSpec
from yinian.mesh_probe import workers_by_role

VOCAB = 500  # prompt ids below every preset's vocabulary
# (TTFT prompt lengths, equality prompt lengths, runs per TTFT length)
GPU_PROMPTS = ((1024, 8192, 32768), (1, 200, 1500, 3000), 3)
DRY_PROMPTS = ((16, 40), (1, 20, 50), 1)
TTFT_PARTS = ("ttft_s", "queue_s", "prefill_s", "transfer_s", "first_decode_s", "bytes", "blocks")


def engine_argv(device: str, dtype: str = "") -> list[str]:
    argv = ["--device", device, "--load-format", "dummy", "--max-num-batched-tokens", "8192",
            "--max-num-seqs", "64"]  # fmt: skip
    if dtype:
        return [*argv, "--dtype", dtype]
    if device == "cuda":
        return [*argv, "--dtype", "bfloat16", "--max-model-len", "40960"]
    return argv


def split_spec(
    folder, device: str, decode: int, transports: str, blocks: tuple[int, int], dtype: str = "",
    scheduler_argv=(), decode_argv=(), **spec,
) -> MeshSpec:  # fmt: skip
    """One prefill worker and `decode` decode workers (dummy weights) offering `transports`,
    every prompt handed off; blocks: the (prefill, decode) KV blocks."""
    return MeshSpec(
        model=str(folder),
        workers=0,
        prefill=1,
        decode=decode,
        port=0,
        engine_argv=engine_argv(device, dtype),
        scheduler_argv=["--disagg-min-tokens", "1", *scheduler_argv],
        worker_argv=["--kv-transports", transports],
        role_argv={
            "prefill": ["--num-gpu-blocks", str(blocks[0])],
            "decode": ["--num-gpu-blocks", str(blocks[1]), *decode_argv],
        },
        **spec,
    )


def endpoints(mesh, decode_id: str | None = None) -> tuple[worker_pb2_grpc.DecodeStub, str]:
    """(a stub of the decode worker `decode_id`, or the first listed; the prefill address)."""
    roles = workers_by_role(mesh)
    decode = next(w for w in roles["decode"] if decode_id in (None, w.worker_id))
    stub = worker_pb2_grpc.DecodeStub(sync_channel(decode.address, None))
    return stub, roles["prefill"][0].address


def generate(stub, request_id: str, prompt: list[int], tenant: str, prefill_address: str = "",
             max_tokens: int = 8, logprobs: int | None = None) -> dict:  # fmt: skip
    params = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    if logprobs is not None:
        params.logprobs = logprobs
    request = worker_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                         params=params, tenant=tenant,
                                         prefill_address=prefill_address)  # fmt: skip
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
    """Medians over `runs` fresh prompts of `length` tokens (after one warm-up prompt)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(runs + 1):  # the first run warms this length up
        prompt = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        out = generate(decode_stub, f"pd-{length}-{i}", prompt, "pd", prefill_address)
        t = out["timings"]
        rows.append({
            "ttft_s": out["ttft_s"], "queue_s": t.queue_seconds, "prefill_s": t.prefill_seconds,
            "transfer_s": t.transfer_seconds, "first_decode_s": t.first_decode_seconds,
            "bytes": t.transfer_bytes, "blocks": t.transfer_blocks, "transport": t.transport,
        })  # fmt: skip
    measured = rows[1:]
    result = {k: statistics.median(r[k] for r in measured) for k in TTFT_PARTS}
    return result | {
        "length": length,
        "runs": measured,
        "transport": measured[0]["transport"],
        "transfer_share_of_ttft": result["transfer_s"] / result["ttft_s"],
    }


def equality(decode_stub, prefill_address: str, lengths, seed: int = 1) -> list[dict]:
    """Per prompt length: the split path's greedy tokens against the decode worker's own,
    where they part, and the two candidates' logprob gap under the local run."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, length in enumerate(lengths):
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
        out.append({
            "length": length, "equal": split["tokens"] == local["tokens"],
            "diverged_at": diverged, "logprob_gap": gap, "split": split["tokens"],
            "local": local["tokens"], "transport": split["timings"].transport,
        })  # fmt: skip
    return out


def print_results(results: dict) -> None:
    """The equality lines and the TTFT table of either script's results."""
    eq = results.get("equality")
    for e in eq if isinstance(eq, list) else []:
        print(f"split == local, {e['length']} tokens ({e['transport']}): {e['equal']}"
              + ("" if e["equal"] else f" (diverged at {e['diverged_at']}, "
                 f"gap {e['logprob_gap']})"))  # fmt: skip
    print("| prompt | TTFT ms | queue | prefill | transfer | first decode | transfer share "
          "| MB | GB/s | transport |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    ttft = results.get("ttft")
    for r in ttft if isinstance(ttft, list) else []:
        gbps = r["bytes"] / r["transfer_s"] / 1e9 if r["transfer_s"] else 0
        print(f"| {r['length']} | {r['ttft_s'] * 1e3:.1f} | {r['queue_s'] * 1e3:.1f} | "
              f"{r['prefill_s'] * 1e3:.1f} | {r['transfer_s'] * 1e3:.1f} | "
              f"{r['first_decode_s'] * 1e3:.1f} | {r['transfer_share_of_ttft']:.1%} | "
              f"{r['bytes'] / 1e6:.0f} | {gbps:.0f} | {r['transport']} |")  # fmt: skip
