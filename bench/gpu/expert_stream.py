"""The stream-ordered expert path (services/expert_parallel/stream_port.py) on one
GPU: a worker's MoE layers in a CUDA graph handing their tokens to expert
services in other processes, against the same layers computed in the worker.

deepseek-v2-lite's MoE shapes (hidden 2048, expert width 1408, 64 experts, top-6,
26 MoE layers, random bf16 weights); the members hold 64 / M experts each. Each
layer's output is added to its input (a residual stream: s76's run chained the
outputs alone, whose values shrank toward zero, so its `max_rel_diff` of 0 said
nothing). Per batch T: `colocated_us`, the worker's graph of the 26 layers;
`stream_us`, its graph of 26 hand-offs (send, the members' partial sums, their
sum); four_members_graphs: each member replays a graph per (layer, slot, T)
(captured on its second sight), four_members_eager: the members compute eagerly;
one_member_graphs: a single member holding all 64 experts, so what the stream
path adds to the same compute is its hand-offs alone.
Every process is a client of an MPS daemon this run starts (as `yinian up`
runs them); the outputs of the stream path are checked against colocated.

Usage: python -m bench.gpu.expert_stream --out bench/results/expert_stream.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from bench.gpu.sections import Sections, script_parser

HIDDEN, WIDTH, EXPERTS, TOP_K, LAYERS = 2048, 1408, 64, 6, 26
BATCHES = (1, 64)

_COMMON = textwrap.dedent("""
    import json, os, sys, time, torch
    from kernels import ops
    from kernels.cuda_ops import register
    register()
    H, W, E, K, L = 2048, 1408, 64, 6, 26
    dev = torch.device("cuda", 0)
    def layer_weights(layer, experts):
        g = torch.Generator(device=dev).manual_seed(layer)
        w13 = torch.randn(E, 2 * W, H, device=dev, generator=g).to(torch.bfloat16) * H ** -0.5
        w2 = torch.randn(E, H, W, device=dev, generator=g).to(torch.bfloat16) * W ** -0.5
        return w13[experts].contiguous(), w2[experts].contiguous()
    def inputs(t, seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        x = torch.randn(t, H, device=dev, generator=g).to(torch.bfloat16)
        logits = torch.randn(t, E, device=dev, generator=g)
        weights, ids = ops.moe_route(logits, K, True)
        return x, weights.float().contiguous(), ids.to(torch.int32).contiguous()
    def timed(fn, reps=50):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / reps * 1e6
""")

_MEMBER = _COMMON + textwrap.dedent("""
    from services.expert_parallel.stream_member import StreamMember
    rank, members, graphs = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    held = list(range(rank * E // members, (rank + 1) * E // members))
    local = torch.full((E,), -1, dtype=torch.int64, device=dev)
    local[held] = torch.arange(len(held), device=dev)
    weights_of = [layer_weights(l, held) for l in range(L)]
    member = StreamMember(open(sys.argv[1], "rb").read(), dev)
    print("open", flush=True)
    seen, captured = set(), {}
    pool = torch.cuda.graph_pool_handle()
    def compute(layer, tokens, weights, ids):
        mine = torch.where(ids >= 0, local[ids.clamp(min=0).long()], -1).to(torch.int32)
        return ops.fused_moe(tokens, *weights_of[layer], weights, mine)
    while (got := member.receive()) is not None:
        layer, tokens, weights, ids = got
        key = (layer, member._slot, tokens.shape[0])
        if key in captured:
            captured[key].replay()
            continue
        if graphs and key in seen:
            g = torch.cuda.CUDAGraph()
            slot = member._slot
            with torch.cuda.graph(g, pool=pool):
                member.reply(compute(layer, tokens, weights, ids))
                member._slot = slot
            member._slot = None
            captured[key] = g
            g.replay()
            continue
        seen.add(key)
        member.reply(compute(layer, tokens, weights, ids))
    member.close()
""")

_WORKER = _COMMON + textwrap.dedent("""
    from services.expert_parallel.stream_port import StreamPort
    folder, members, graphs = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    port = StreamPort(members, torch.bfloat16, H, K, dev, timeout=60.0, capacity=64)
    procs = []
    for rank in range(members):
        path = os.path.join(folder, f"m{rank}")
        open(path, "wb").write(port.description(rank + 1))
        import subprocess
        procs.append(subprocess.Popen([sys.executable, "-c", os.environ["MEMBER_CODE"], path,
                                       str(rank), str(members), graphs], stdout=subprocess.PIPE,
                                      text=True))
    for p in procs:
        assert p.stdout.readline().strip() == "open"
    port.opened()
    everything = [layer_weights(l, list(range(E))) for l in range(L)]
    owner = torch.arange(E, device=dev) // (E // members)
    out = {"members": members, "member_graphs": graphs == "1", "by_batch": []}
    for t in (1, 64):
        x, weights, ids = inputs(t, t)
        split = torch.where(owner[ids.long()] == torch.arange(members, device=dev)[:, None, None],
                            ids, -1)
        # each layer's input is the last one's plus its output (a residual stream), so the
        # values keep their size through the 26 layers and the comparison means something
        def colocated():
            h = x
            for l in range(L):
                h = h + ops.fused_moe(h, *everything[l], weights, ids)
            return h
        def stream():
            port.begin_step()
            h = x
            for l in range(L):
                h = h + port.combine(port.send(l, h, weights, split))
            return h
        row = {"tokens": t}
        for name, fn in (("colocated", colocated), ("stream", stream)):
            fn()  # tunes, warms the members
            fn()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                result = fn()
            row[name + "_us"] = timed(g.replay)
            row[name + "_out"] = result.float()
        want = row.pop("colocated_out")
        diff = (row.pop("stream_out") - want).abs().max().item()
        row["max_rel_diff"] = diff / max(want.abs().max().item(), 1e-30)
        row["stream_over_colocated"] = row["stream_us"] / row["colocated_us"]
        out["by_batch"].append(row)
        print(json.dumps(row), flush=True)
    port.close()
    for p in procs:
        p.wait(30)
    print("RESULT " + json.dumps(out), flush=True)
""")


def _run(members: int, graphs: bool) -> dict:
    from yinian.mps import MpsDaemon

    with tempfile.TemporaryDirectory(prefix="stream-") as folder:
        daemon = MpsDaemon(Path(folder))
        env = dict(os.environ, **daemon.start(), MEMBER_CODE=_MEMBER)
        try:
            done = subprocess.run([sys.executable, "-c", _WORKER, folder, str(members),
                                   "1" if graphs else "0"], env=env, capture_output=True,
                                  text=True, timeout=400)  # fmt: skip
        finally:
            daemon.stop()
    print(done.stdout[-3000:], done.stderr[-3000:], flush=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"the worker exited {done.returncode}: {done.stderr[-1500:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> dict:
    args = script_parser(__doc__).parse_args(argv)
    with Sections(args, script="expert_stream") as section:
        section("four_members_graphs", lambda: _run(4, True), needs="CUDA")
        section("four_members_eager", lambda: _run(4, False), needs="CUDA")
        # one member holding every expert: what a hand-off costs beyond the same compute
        section("one_member_graphs", lambda: _run(1, True), needs="CUDA")
        return section.results


if __name__ == "__main__":
    main()
