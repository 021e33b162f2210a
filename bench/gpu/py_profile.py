"""Where a mesh's processes spend their Python time while a load runs: py-spy
samples each named child's stacks (every thread, idle frames left out) and the
frames are ranked by the share of busy samples that pass through them. For the
GPU scripts, which cannot attach a debugger there: the ranking, not the raw
samples, goes into their results.

    with Profile(children(mesh, ["worker-0", "gateway"]), seconds=5) as profile:
        ...load...
    profile.top(40)  # {"worker-0": {"busy_samples": n, "frames": [[share, frame], ...]}}
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

# leaf frames of a thread that waits: not time spent
_IDLE = ("select", "epoll", "poll (", "_run_once (asyncio", "wait (threading", "acquire",
         "_worker (concurrent", "sleep", "accept", "recv")  # fmt: skip


def children(mesh, names: list[str]) -> dict[str, int]:
    """name -> pid of a mesh's children."""
    return {name: mesh.child(name).proc.pid for name in names}


class Profile:
    def __init__(self, pids: dict[str, int], seconds: float, rate: int = 500):
        self.pids, self.seconds, self.rate = pids, seconds, rate
        self.folder = Path(tempfile.mkdtemp(prefix="py-spy-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.error = "" if shutil.which("py-spy") else "py-spy is not installed"

    def __enter__(self) -> Profile:
        if self.error:
            return self
        for name, pid in self.pids.items():
            self.procs[name] = subprocess.Popen(
                ["py-spy", "record", "-p", str(pid), "-o", str(self.folder / f"{name}.txt"),
                 "-f", "raw", "-r", str(self.rate), "-d", str(max(1, round(self.seconds))),
                 "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
        return self

    def __exit__(self, *exc) -> None:
        for name, proc in self.procs.items():
            try:
                _, err = proc.communicate(timeout=self.seconds + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                err = "py-spy did not finish"
            if proc.returncode:
                self.error += f"{name}: {err.strip()[-300:]} "

    def top(self, count: int = 40) -> dict:
        out: dict = {"error": self.error} if self.error else {}
        for name in self.procs:
            path = self.folder / f"{name}.txt"
            if path.is_file():
                out[name] = ranked(path.read_text(), count)
        shutil.rmtree(self.folder, ignore_errors=True)
        return out


def ranked(raw: str, count: int) -> dict:
    """py-spy's raw output ("frame;frame;... N" per line) as the `count` frames most
    busy samples pass through, and the `count` frames most of them end in (where
    the time is spent), with their shares."""
    through: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    busy = 0
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        if any(word in frames[-1] for word in _IDLE):
            continue
        busy += int(n)
        leaves[frames[-1]] += int(n)
        for frame in set(frames):
            through[frame] += int(n)

    def share(counter: Counter) -> list:
        return [[round(n / busy, 4), f] for f, n in counter.most_common(count)] if busy else []

    return {"busy_samples": busy, "frames": share(through), "leaves": share(leaves)}
