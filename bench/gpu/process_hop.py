"""What one hop between two processes on one GPU costs: the floor under the expert
services' same-host path (services/expert_parallel/mailbox.py), which makes two
such hops per MoE layer (rows to a service, its reply back).

Each section runs in fresh child processes (this process never touches the GPU),
N round trips of: side A runs a one-element kernel and records an event; side B's
stream waits on it, runs its own one-element kernel and records a second event,
which A's stream waits on before its next kernel.

- in_process: A and B are two streams of one process (no handshake, one context).
- cross_process: A and B are two processes; the events are interprocess (CUDA IPC)
  and each side learns the other's record through a spin on shared host memory.
- cross_process_mps: the same under an MPS control daemon this section starts (a
  private pipe directory: only these two processes are its clients) and stops;
  skipped where nvidia-cuda-mps-control is missing.

Each is timed two ways: `pipelined_us` (A never waits on its host: what a step
that enqueues ahead pays per hop pair) and `synced_us` (A's host waits for B's
kernel each time: what a step pays where the host reads a device value each layer,
as a routing count does).

Usage: python -m bench.gpu.process_hop --out bench/results/process_hop.json
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from bench.gpu.sections import Sections, script_parser

ROUNDS = 2000

_CHILD = textwrap.dedent("""
    import mmap, os, pickle, sys, time, torch
    role, folder, rounds, synced = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    dev = torch.device("cuda", 0)
    x = torch.zeros(1, device=dev)
    stream = torch.cuda.current_stream(dev)
    if role == "both":  # one process, two streams
        other = torch.cuda.Stream(dev)
        ea, eb = torch.cuda.Event(), torch.cuda.Event()
        y = torch.zeros(1, device=dev)
        for warm in (True, False):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(50 if warm else rounds):
                x.add_(1); ea.record(stream)
                other.wait_event(ea)
                with torch.cuda.stream(other):
                    y.add_(1)
                eb.record(other); stream.wait_event(eb)
                if synced:
                    eb.synchronize()
            torch.cuda.synchronize()
        print((time.perf_counter() - start) / rounds * 1e6, flush=True)
        sys.exit()
    fd = os.open(os.path.join(folder, "flags"), os.O_RDWR)
    flags = memoryview(mmap.mmap(fd, 4096)).cast("q")
    handles = os.path.join(folder, "events")
    if role == "a":
        ea, eb = (torch.cuda.Event(interprocess=True) for _ in range(2))
        ea.record(stream); eb.record(stream)
        with open(handles + ".tmp", "wb") as f:
            pickle.dump([bytes(ea.ipc_handle()), bytes(eb.ipc_handle())], f)
        os.rename(handles + ".tmp", handles)
    else:
        while not os.path.exists(handles):
            time.sleep(0.001)
        got = pickle.load(open(handles, "rb"))
        ea, eb = (torch.cuda.Event.from_ipc_handle(dev, h) for h in got)
    torch.cuda.synchronize()
    total, i = 50 + rounds, 0
    while i < total:
        i += 1
        if role == "a":
            if i == 51:
                torch.cuda.synchronize()
                start = time.perf_counter()
            x.add_(1); ea.record(stream)
            flags[0] = i
            while flags[1] < i:
                pass
            stream.wait_event(eb)
            if synced:
                eb.synchronize()
        else:
            while flags[0] < i:
                pass
            stream.wait_event(ea)
            x.add_(1); eb.record(stream)
            flags[1] = i
    torch.cuda.synchronize()
    if role == "a":
        print((time.perf_counter() - start) / rounds * 1e6, flush=True)
""")


def _run(cmd: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)


def _one(mode: str, synced: bool, env: dict) -> float:
    with tempfile.TemporaryDirectory(prefix="hop-", dir="/dev/shm") as folder:
        Path(folder, "flags").write_bytes(bytes(4096))
        argv = lambda role: [sys.executable, "-c", _CHILD, role, folder, str(ROUNDS),  # noqa: E731
                             "1" if synced else "0"]  # fmt: skip
        if mode == "in_process":
            out = subprocess.run(argv("both"), env=env, capture_output=True, text=True,
                                 timeout=120, check=True)  # fmt: skip
            return float(out.stdout.split()[-1])
        a, b = _run(argv("a"), env), _run(argv("b"), env)
        out_a, _ = a.communicate(timeout=120)
        b.communicate(timeout=30)
        if a.returncode or b.returncode:
            raise RuntimeError(f"children exited {a.returncode}, {b.returncode}")
        return float(out_a.split()[-1])


def _pair(mode: str, env: dict | None = None) -> dict:
    env = env or dict(os.environ)
    return {"pipelined_us": _one(mode, False, env), "synced_us": _one(mode, True, env),
            "rounds": ROUNDS}  # fmt: skip


def _mps() -> dict:
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        return {"skipped": "nvidia-cuda-mps-control is not on this machine"}
    folder = tempfile.mkdtemp(prefix="mps-")
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=f"{folder}/pipe",
               CUDA_MPS_LOG_DIRECTORY=f"{folder}/log")  # fmt: skip
    os.makedirs(env["CUDA_MPS_PIPE_DIRECTORY"])
    os.makedirs(env["CUDA_MPS_LOG_DIRECTORY"])
    subprocess.run([control, "-d"], env=env, check=True, timeout=30)
    try:
        time.sleep(1)
        return _pair("cross_process", env)
    finally:
        subprocess.run([control], input="quit\n", env=env, text=True, timeout=30)
        time.sleep(1)


def main(argv: list[str] | None = None) -> dict:
    args = script_parser(__doc__).parse_args(argv)
    with Sections(args, script="process_hop") as section:
        section("in_process", lambda: _pair("in_process"), needs="CUDA")
        section("cross_process", lambda: _pair("cross_process"), needs="CUDA")
        section("cross_process_mps", _mps, needs="CUDA")
        for name in ("in_process", "cross_process", "cross_process_mps"):
            row = section.results.get(name) or {}
            if "synced_us" in row:
                print(f"{name}: {row['pipelined_us']:.1f} us a round trip pipelined, "
                      f"{row['synced_us']:.1f} us synced")  # fmt: skip
        return section.results


if __name__ == "__main__":
    main()
