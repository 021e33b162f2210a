"""Can a worker's step hand its MoE layers to another process with no host in the
loop? A probe of CUDA stream memory operations (cuStreamWriteValue64 /
cuStreamWaitValue64, driver API through ctypes) on flags in shared host memory
mapped for the device, inside a captured CUDA graph.

The worker process runs, per "layer", a one-element kernel, writes SENT=1 from
its stream, waits on its stream (no SM held) for REPLIED==1 and resets it; the
member process's host spins on SENT, resets it, runs its own one-element kernel
and writes REPLIED=1 from its stream (so the worker's stream goes on only once
the member's kernel is done). The worker's layers are captured in one CUDA graph
and replayed; `eager` issues the same calls without a graph.

Sections: in_graph (the layers captured and replayed: whether capture takes the
memory operations, and the time per layer), eager, and the same under an MPS
daemon of this run's own (in_graph_mps).

Usage: python -m bench.gpu.memops_probe --out bench/results/memops_probe.json
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

LAYERS, ROUNDS = 26, 100  # deepseek-v2-lite's MoE layers; steps replayed

_CHILD = textwrap.dedent("""
    import ctypes, json, mmap, os, sys, time, torch
    role, path = sys.argv[1], sys.argv[2]
    layers, rounds, graph = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
    lib = ctypes.CDLL("libcuda.so.1")
    def fn(name, argtypes):
        f = getattr(lib, name + "_v2", None) or getattr(lib, name)
        f.restype, f.argtypes = ctypes.c_int, argtypes
        return f
    U64, UINT, PTR = ctypes.c_uint64, ctypes.c_uint, ctypes.c_void_p
    write64 = fn("cuStreamWriteValue64", [PTR, U64, U64, UINT])
    wait64 = fn("cuStreamWaitValue64", [PTR, U64, U64, UINT])
    devptr = fn("cuMemHostGetDevicePointer", [ctypes.POINTER(U64), PTR, UINT])
    EQ = 0x1
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    flags = torch.from_file(path, shared=True, size=2 * layers, dtype=torch.int64)
    nbytes = flags.numel() * 8
    err = int(torch.cuda.cudart().cudaHostRegister(flags.data_ptr(), nbytes, 0x01 | 0x02))
    if err:
        print(json.dumps({"error": f"cudaHostRegister: {err}"})); sys.exit(1)
    d = ctypes.c_uint64()
    err = devptr(ctypes.byref(d), ctypes.c_void_p(flags.data_ptr()), 0)
    if err:
        print(json.dumps({"error": f"cuMemHostGetDevicePointer: {err}"})); sys.exit(1)
    sent = [d.value + 8 * l for l in range(layers)]
    replied = [d.value + 8 * (layers + l) for l in range(layers)]
    host = memoryview(flags.numpy()).cast("B").cast("q")
    x = torch.zeros(1, device=dev)
    def check(err, what):
        if err:
            raise RuntimeError(f"{what}: CUresult {err}")
    if role == "member":
        stream = torch.cuda.current_stream(dev)
        for r in range(rounds + 3):
            for l in range(layers):
                end = time.monotonic() + 30
                while host[l] != 1:
                    if time.monotonic() > end:
                        sys.exit(3)
                host[l] = 0
                x.add_(1)
                check(write64(stream.cuda_stream, replied[l], 1, 0), "write")
        torch.cuda.synchronize()
        sys.exit(0)
    def step(stream):
        for l in range(layers):
            x.add_(1)
            check(write64(stream.cuda_stream, sent[l], 1, 0), "write")
            check(wait64(stream.cuda_stream, replied[l], 1, EQ), "wait")
            check(write64(stream.cuda_stream, replied[l], 0, 0), "write")
    out = {"layers": layers, "rounds": rounds, "graph": graph}
    if graph:
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(dev)
        try:
            with torch.cuda.graph(g, stream=side):
                step(torch.cuda.current_stream(dev))
        except Exception as exc:
            out["capture_error"] = str(exc)[:300]
            print(json.dumps(out)); sys.exit(2)
        run = g.replay
    else:
        run = lambda: step(torch.cuda.current_stream(dev))
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(rounds):
        run()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    out.update(step_us=seconds / rounds * 1e6, layer_us=seconds / rounds / layers * 1e6,
               x=float(x.item()))
    print(json.dumps(out), flush=True)
""")


def _pair(graph: bool, env: dict | None = None) -> dict:
    env = env or dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="memops-", dir="/dev/shm") as folder:
        path = Path(folder, "flags")
        path.write_bytes(bytes(16 * LAYERS))
        argv = [str(path), str(LAYERS), str(ROUNDS), "1" if graph else "0"]
        member = subprocess.Popen([sys.executable, "-c", _CHILD, "member", *argv], env=env)
        worker = subprocess.run([sys.executable, "-c", _CHILD, "worker", *argv], env=env,
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        try:
            member.wait(timeout=30)
        except subprocess.TimeoutExpired:
            member.kill()
        lines = [ln for ln in worker.stdout.splitlines() if ln.startswith("{")]
        out = json.loads(lines[-1]) if lines else {}
        out.update(worker_exit=worker.returncode, member_exit=member.returncode)
        if worker.returncode:
            out["stderr"] = worker.stderr[-1500:]
        return out


def _mps(graph: bool) -> dict:
    import shutil

    from yinian.mps import CONTROL, MpsDaemon

    if shutil.which(CONTROL) is None:
        return {"skipped": f"{CONTROL} is not on this machine"}
    with tempfile.TemporaryDirectory(prefix="mps-") as folder:
        daemon = MpsDaemon(Path(folder))
        try:
            return _pair(graph, dict(os.environ, **daemon.start()))
        finally:
            daemon.stop()


def main(argv: list[str] | None = None) -> dict:
    args = script_parser(__doc__).parse_args(argv)
    with Sections(args, script="memops_probe") as section:
        section("in_graph", lambda: _pair(True), needs="CUDA")
        section("eager", lambda: _pair(False), needs="CUDA")
        section("in_graph_mps", lambda: _mps(True), needs="CUDA")
        for name in ("in_graph", "eager", "in_graph_mps"):
            row = section.results.get(name) or {}
            print(f"{name}: {json.dumps(row)[:400]}", flush=True)
        return section.results


if __name__ == "__main__":
    main()
