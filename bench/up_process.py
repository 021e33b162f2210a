"""`yinian up` in a child process, its output read line by line (tests and the
benchmarks that start a mesh the way a user does)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path


class UpProcess:
    """`yinian up` in a child process, its output collected line by line."""

    def __init__(self, *argv: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "yinian", "up", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    @property
    def url(self) -> str:
        """The gateway's REST address, as the banner names it (a `--port 0` mesh)."""
        found = re.search(r"REST \(OpenAI\):\s+(\S+)/v1", self.output)
        assert found, f"no REST address in:\n{self.output}"
        return found.group(1)

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            assert self.proc.poll() is None, f"yinian up exited:\n{self.output}"
            assert time.monotonic() < deadline, f"no {text!r} in:\n{self.output}"
            time.sleep(0.1)

    def ready_lines(self, worker: str) -> list[list[str]]:
        """[address, "metrics", metrics address] of each READY line in a worker's log."""
        logs = Path(re.search(r"\(logs in (\S+)\)", self.output).group(1))
        return [line.split()[3:6] for line in (logs / f"{worker}.log").read_text().splitlines()
                if line.startswith(f"READY worker {worker} ")]  # fmt: skip

    def metrics_address(self, worker: str) -> str:
        return self.ready_lines(worker)[-1][2]

    def children(self) -> dict[str, int]:
        """The services it runs: worker id (or module name) -> pid."""
        out = {}
        pids = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True,
                              text=True).stdout.split()  # fmt: skip
        for pid in pids:
            try:
                argv = open(f"/proc/{pid}/cmdline").read().split("\0")
            except OSError:
                continue
            if "--worker-id" in argv:
                name = argv[argv.index("--worker-id") + 1]
            else:  # `python -m MODULE ...`; a process that renamed itself (redis-server)
                name = argv[2] if len(argv) > 2 else argv[0]
            out[name] = int(pid)
        return out
