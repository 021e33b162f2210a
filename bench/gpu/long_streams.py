"""Streams of 4k-token prompts through the gateway on one GPU: every stream must
end with its tokens and a finish reason, or with an error event; a 200 stream
that ends with neither is the failure this run looks for.

Two meshes on the llama3-8b preset (bf16, dummy weights): one colocated worker,
and a prefill worker with a decode worker (KV over cuda_ipc). Each gets rounds of
`--streams` concurrent streamed completions of 4096 random-token prompts (128
tokens out, end of sequence ignored), where one client in four hangs up after
three events, then a round of whole completions. Recorded per round: streams
complete, ended with an error event, ended with neither, clients that left,
HTTP statuses, TTFT p50/p99 and the wall time; the ceilings of the same run are
in `ceilings` (this run makes no speed claim).

Usage: python -m bench.gpu.long_streams --out bench/results/long_streams.json
           [--streams N] [--rounds N] [--skip colocated split]
Sections: ceilings, colocated, split. `--device cpu` is the dry run (tiny-llama).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import httpx

from bench.gpu import ceilings, pd_mesh
from bench.gpu.models import preset_folder
from bench.gpu.sections import Sections, script_parser
from bench.loadgen.client import RequestInput, hang_up_after, send_request
from yinian.mesh import Mesh, MeshSpec

GPU = {"preset": "llama3-8b", "prompt": 4096, "output": 128}
DRY = {"preset": "tiny-llama", "prompt": 200, "output": 8}
VOCAB = 500


def colocated_spec(folder, device: str) -> MeshSpec:
    argv = ["--device", device, "--load-format", "dummy", "--max-num-seqs", "128"]
    if device == "cuda":
        argv += ["--dtype", "bfloat16", "--max-model-len", "8192"]
    return MeshSpec(model=str(folder), workers=1, port=0, engine_argv=argv)


def split_spec(folder, device: str) -> MeshSpec:
    cuda = device == "cuda"
    blocks = (12000, 16000) if cuda else (1000, 1000)
    return pd_mesh.split_spec(folder, device, 1, "cuda_ipc,tcp" if cuda else "tcp", blocks)


async def one_round(url: str, model: str, w: dict, streams: int, seed: int, stream: bool):
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(w["prompt"])] for _ in range(streams)]
    outcome = {"complete": 0, "error_event": 0, "neither": 0, "left": 0, "http_errors": 0,
               "statuses": {}, "samples": []}  # fmt: skip
    ttfts: list[float] = []
    limits = httpx.Limits(max_connections=streams + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def run(i: int) -> None:
            body = {"model": model, "prompt": prompts[i], "max_tokens": w["output"],
                    "stream": True, "ignore_eos": True}  # fmt: skip
            if stream and i % 4 == 3:
                said = await hang_up_after(client, f"{url}/v1/completions", body, events=3)
                outcome["left" if said == "left" else "http_errors"] += 1
                return
            req = RequestInput(f"{url}/v1/completions", model, prompts[i], w["prompt"],
                               w["output"], ignore_eos=True)  # fmt: skip
            if not stream:
                await whole(client, url, body, outcome)
                return
            result = await send_request(client, req)
            code = str(result.status_code)
            outcome["statuses"][code] = outcome["statuses"].get(code, 0) + 1
            if result.success and result.output_tokens > 0:
                outcome["complete"] += 1
                ttfts.append(result.ttft)
            elif result.status_code != 200:
                outcome["http_errors"] += 1
            elif result.error.startswith("{") or '"error"' in result.error:
                outcome["error_event"] += 1
            else:
                outcome["neither"] += 1
            if not result.success and len(outcome["samples"]) < 5:
                outcome["samples"].append(result.error[:300])

        start = time.monotonic()
        await asyncio.gather(*(run(i) for i in range(streams)))
        outcome["seconds"] = time.monotonic() - start
    if ttfts:
        ttfts.sort()
        outcome["ttft_p50_s"] = statistics.median(ttfts)
        outcome["ttft_p99_s"] = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
    return outcome


async def whole(client: httpx.AsyncClient, url: str, body: dict, outcome: dict) -> None:
    resp = await client.post(f"{url}/v1/completions", json=body | {"stream": False})
    code = str(resp.status_code)
    outcome["statuses"][code] = outcome["statuses"].get(code, 0) + 1
    if resp.status_code != 200:
        outcome["http_errors"] += 1
        return
    choice = resp.json()["choices"][0]
    tokens = resp.json()["usage"]["completion_tokens"]
    outcome["complete" if choice.get("finish_reason") and tokens > 0 else "neither"] += 1


def mesh_rounds(spec: MeshSpec, model: str, w: dict, streams: int, rounds: int) -> dict:
    mesh = Mesh(spec)
    mesh.start(timeout=900)
    try:
        out = {}
        for r in range(rounds):
            out[f"streamed_{r}"] = asyncio.run(one_round(mesh.url, model, w, streams, r, True))
        out["whole"] = asyncio.run(one_round(mesh.url, model, w, streams, 99, False))
        out["neither_total"] = sum(v["neither"] for v in out.values() if isinstance(v, dict))
        return out
    finally:
        mesh.stop()


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--streams", type=int, help="concurrent streams (64; dry run 8)")
    parser.add_argument("--rounds", type=int, help="streamed rounds per mesh (2; dry run 1)")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    w = GPU if cuda else DRY
    args.streams = args.streams or (64 if cuda else 8)
    args.rounds = args.rounds or (2 if cuda else 1)
    with Sections(args, script="long_streams", workload=w, streams=args.streams) as section:
        device = section.device
        section("ceilings", lambda: ceilings.measure(device))
        folder, _ = preset_folder(section.tmp, w["preset"])
        model = w["preset"]  # the gateway serves the folder under its name
        for name, make in (("colocated", colocated_spec), ("split", split_spec)):
            section(name, lambda make=make: mesh_rounds(make(folder, device), model, w,
                                                        args.streams, args.rounds))  # fmt: skip
        print_table(section.results)
        return section.results


def print_table(results: dict) -> None:
    print("| mesh | round | complete | error event | neither | left | HTTP errors | "
          "TTFT p50 / p99 (s) | wall (s) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for mesh in ("colocated", "split"):
        entry = results.get(mesh) or {}
        for name, r in entry.items():
            if not isinstance(r, dict) or "complete" not in r:
                continue
            ttft = (f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f}"
                    if "ttft_p50_s" in r else "-")  # fmt: skip
            print(
                f"| {mesh} | {name} | {r['complete']} | {r['error_event']} | {r['neither']} "
                f"| {r['left']} | {r['http_errors']} | {ttft} | {r['seconds']:.1f} |"
            )


if __name__ == "__main__":
    main()
