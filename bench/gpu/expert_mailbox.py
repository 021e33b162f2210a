"""The same-host expert data path alone (services/expert_parallel/mailbox.py):
a worker's mailbox port and one member in another process, on the GPU through
CUDA IPC (host shared memory with --device cpu).

round_trip (and round_trip_no_spin: each end sleeps on its doorbell at once, no
polling first; round_trip_mps: both processes clients of an MPS daemon, as `yinian
up` runs them on one GPU): per row count (decode at 1 and 64 tokens x top-8, a 4k prefill
chunk's pairs), the member answers each dispatch with its rows unchanged
(the reply is the activations themselves), the worker checks every
reply bit for bit, and the time a dispatch takes in a run of many back to back
(send, then wait: the member has answered and the reply's copy is queued on
the worker's stream; the device is synchronized once at the end, so this is
what each adds, pipelined), against the same bytes copied once on the device
(the payload there and the reply back: the copy ceiling, same run).
On the CPU both processes run one thread (their thread pools, spinning on
two cores, cost each copy milliseconds).

Usage: python -m bench.gpu.expert_mailbox --out bench/results/expert_mailbox.json [--device cpu]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from functools import partial
from pathlib import Path

import torch

from bench.gpu.sections import Sections, script_parser
from services.expert_parallel.mailbox import MailboxPort

HIDDEN = 2048  # qwen3-30b-a3b
ROWS = (8, 512, 4096)

_MEMBER = textwrap.dedent("""
    import sys, torch
    from services.expert_parallel.mailbox_member import MemberMailbox
    device, hidden = torch.device(sys.argv[2]), int(sys.argv[3])
    dtype = getattr(torch, sys.argv[4])
    if device.type == "cpu":
        torch.set_num_threads(1)
    spin = None if sys.argv[5] == "default" else float(sys.argv[5])
    box = MemberMailbox(open(sys.argv[1], "rb").read(), device, spin=spin)
    print("open", flush=True)
    import time, statistics
    waits, replies = [], []
    while True:
        t0 = time.perf_counter()
        got = box.receive()
        t1 = time.perf_counter()
        if got is None:
            break
        box.reply(got[1])  # the rows themselves
        waits.append(t1 - t0); replies.append(time.perf_counter() - t1)
    med = lambda xs: statistics.median(xs) * 1e6 if xs else 0.0
    print(f"member {med(waits):.1f} {med(replies):.1f}", flush=True)
""")


def _copy_ceiling(nbytes: int, device: torch.device, repeats: int) -> float:
    """Seconds to copy `nbytes` once on the device (the same run's ceiling)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _sync(device)
    return (time.perf_counter() - start) / repeats


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def round_trip(device: torch.device, rows_list, repeats: int, spin: float | None) -> dict:
    """spin None: the mailboxes' default (polling before sleeping, on a GPU); 0: each
    end sleeps on its doorbell at once (what a process's wake-up costs)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":  # two processes' thread pools on few cores wait on each other
        torch.set_num_threads(1)
    port = MailboxPort(1, dtype, HIDDEN, device, timeout=30.0, spin=spin)
    with tempfile.TemporaryDirectory() as tmp:
        desc = Path(tmp) / "mailbox"
        desc.write_bytes(port.description(1))
        proc = subprocess.Popen(
            [sys.executable, "-c", _MEMBER, str(desc), str(device), str(HIDDEN),
             str(dtype).removeprefix("torch."), "default" if spin is None else str(spin)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            if proc.stdout.readline().strip() != "open":
                raise RuntimeError("the member could not open its mailbox")
            port.opened()
            out = {"hidden": HIDDEN, "dtype": str(dtype), "spin_seconds": port.spin,
                   "by_rows": []}  # fmt: skip
            for rows in rows_list:
                x = torch.randn(rows, HIDDEN, device=device).to(dtype)
                ids = torch.arange(rows, device=device) % 128
                ok = all(torch.equal(port.send(0, [rows], x, ids).wait(), x) for _ in range(3))
                _sync(device)
                sends, waits = [], []
                start = time.perf_counter()
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    pending = port.send(0, [rows], x, ids)
                    t1 = time.perf_counter()
                    result = pending.wait()
                    sends.append(t1 - t0)
                    waits.append(time.perf_counter() - t1)
                _sync(device)
                seconds = (time.perf_counter() - start) / repeats
                moved = 2 * x.numel() * x.element_size() + ids.numel() * 8
                ceiling = _copy_ceiling(moved, device, repeats)
                row = {"rows": rows, "bytes": moved, "equal": ok and torch.equal(result, x),
                       "round_trip_us": seconds * 1e6, "copy_us": ceiling * 1e6,
                       "copy_over_round_trip": ceiling / seconds,
                       "host_send_us": statistics.median(sends) * 1e6,
                       "host_wait_us": statistics.median(waits) * 1e6}  # fmt: skip
                out["by_rows"].append(row)
                print(f"{rows:5d} rows: {row['round_trip_us']:8.1f} us a dispatch "
                      f"(the copy alone {row['copy_us']:.1f} us), equal {row['equal']}",
                      flush=True)  # fmt: skip
            port.close()  # the member's loop ends and it prints its medians
            tail, _ = proc.communicate(timeout=10)
            words = tail.split()  # "member RECEIVE_US REPLY_US"
            if "member" in words:
                at = words.index("member") + 1
                out["member_receive_us"], out["member_reply_us"] = map(float, words[at : at + 2])
            return out
        finally:
            port.close()
            try:
                proc.wait(10)
            finally:
                proc.kill()


def _profile(fn, calls: int, top: int = 12) -> list[str]:
    """The host functions that took the most of `calls` calls of `fn` (cProfile, by
    own time): where a call's host time goes when it exceeds its kernels'."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return [line for line in text.getvalue().splitlines() if line.strip()][-top - 1 :]


def member_compute(device: torch.device, repeats: int) -> dict:
    """What an expert service's compute of one dispatch costs alone, in one process:
    deepseek-v2-lite's expert shapes, 18 experts held (a quarter of 64 and spares),
    rows spread over them, as `ExpertStore.compute` runs it: the ids mapped to the
    stack, the check that each is held (a host sync), the fused MoE at top-1.
    `pipelined_us`: calls back to back; `with_check_us`: each with that check."""
    from engine.expert_backend import expert_rows

    if device.type == "cuda":  # the Triton kernels, as the expert service registers them
        from kernels.cuda_ops import register

        register()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden, width, held = (2048, 1408, 18) if device.type == "cuda" else (64, 32, 6)
    w13 = torch.randn(held, 2 * width, hidden, device=device).to(dtype) * 0.02
    w2 = torch.randn(held, hidden, width, device=device).to(dtype) * 0.02
    local = torch.arange(64, device=device) % held
    out = {"hidden": hidden, "width": width, "held": held, "by_rows": []}
    for rows in (2, 16, 128):
        x = torch.randn(rows, hidden, device=device).to(dtype)
        ids = torch.arange(rows, device=device) % 64
        timings = {}
        for name, check in (("pipelined_us", False), ("with_check_us", True)):
            for _ in range(3):
                expert_rows(x, w13, w2, local[ids])
            _sync(device)
            start = time.perf_counter()
            for _ in range(repeats):
                mapped = local[ids]
                if check and bool((mapped < 0).any()):
                    raise AssertionError("unreachable")
                expert_rows(x, w13, w2, mapped)
            _sync(device)
            timings[name] = (time.perf_counter() - start) / repeats * 1e6
        out["by_rows"].append(
            {
                "rows": rows,
                **timings,
                "host_profile": _profile(partial(expert_rows, x, w13, w2, local[ids]), 50),
            }
        )
        print(f"member compute {rows:4d} rows: {timings['pipelined_us']:.1f} us pipelined, "
              f"{timings['with_check_us']:.1f} us with the check", flush=True)  # fmt: skip
    return out


def under_mps(rows_list, repeats: int) -> dict:
    """round_trip with both ends clients of an MPS daemon of this run's own (the
    way `yinian up` runs a worker and its expert services on one GPU), in a child
    process: this one has a context outside it already."""
    import json
    import os

    from yinian.mps import MpsDaemon

    with tempfile.TemporaryDirectory(prefix="mps-") as folder:
        daemon = MpsDaemon(Path(folder))
        env = dict(os.environ, **daemon.start())
        try:
            code = ("import json, torch; from bench.gpu.expert_mailbox import round_trip; "
                    f"print(json.dumps(round_trip(torch.device('cuda'), {list(rows_list)}, "
                    f"{repeats}, None)))")  # fmt: skip
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                 text=True, timeout=300)  # fmt: skip
            print(out.stdout, out.stderr[-2000:], flush=True)
            if out.returncode:
                raise RuntimeError(f"the run under MPS exited {out.returncode}")
            return json.loads(out.stdout.strip().splitlines()[-1])
        finally:
            daemon.stop()


def main(argv: list[str] | None = None) -> dict:
    args = script_parser(__doc__).parse_args(argv)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    dry = args.device == "cpu"
    with Sections(args, script="expert_mailbox") as section:
        rows, repeats = (ROWS[:2], 20) if dry else (ROWS, 500)
        section("round_trip", lambda: round_trip(device, rows, repeats, None))
        section("round_trip_no_spin", lambda: round_trip(device, rows, repeats, 0.0))
        section("round_trip_mps", lambda: under_mps(rows, repeats), needs="CUDA")
        section("member_compute", lambda: member_compute(device, 20 if dry else 200))
        return section.results


if __name__ == "__main__":
    main()
