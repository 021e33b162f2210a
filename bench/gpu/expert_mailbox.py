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

import subprocess
import sys
import tempfile
import textwrap
import time
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
    while (got := box.receive()) is not None:
        box.reply(got[1])  # the rows themselves
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
                start = time.perf_counter()
                for _ in range(repeats):
                    result = port.send(0, [rows], x, ids).wait()
                _sync(device)
                seconds = (time.perf_counter() - start) / repeats
                moved = 2 * x.numel() * x.element_size() + ids.numel() * 8
                ceiling = _copy_ceiling(moved, device, repeats)
                row = {"rows": rows, "bytes": moved, "equal": ok and torch.equal(result, x),
                       "round_trip_us": seconds * 1e6, "copy_us": ceiling * 1e6,
                       "copy_over_round_trip": ceiling / seconds}  # fmt: skip
                out["by_rows"].append(row)
                print(f"{rows:5d} rows: {row['round_trip_us']:8.1f} us a dispatch "
                      f"(the copy alone {row['copy_us']:.1f} us), equal {row['equal']}",
                      flush=True)  # fmt: skip
            return out
        finally:
            port.close()
            try:
                proc.wait(10)
            finally:
                proc.kill()


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
        return section.results


if __name__ == "__main__":
    main()
