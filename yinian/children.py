"""The launcher's child processes: each started in a session of its own, its
output copied to a log file, watched for the line that says it is ready, and
waited for (a start-up that an operator cancels ends at once).

Children die with the launcher (Linux parent-death signal), so even a killed
launcher leaves no process behind. The signal follows the thread that started
the child: start children from a thread that lives as long as they should.
Services a preloaded starter forks (basis/preload_client.py, where turned on) die
with the starter, and the starter with the launcher process.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from basis import preload_client
from basis.preload import die_with_parent


class StartCancelled(Exception):
    """The operator stopped the launcher while children were starting."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen | preload_client.ForkedProcess
    ready: threading.Event = field(default_factory=threading.Event)
    ready_line: str = ""
    log_path: Path | None = None
    command: list[str] = field(default_factory=list)  # to start it again
    env: dict[str, str] = field(default_factory=dict)
    starts: int = 1
    says_ready: Callable[[str], bool] = lambda line: line.startswith("READY ")
    last_line: str = ""
    pump: threading.Thread | None = None

    def exit_status(self) -> str:
        code = self.proc.returncode
        if code is not None and code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with {code}"

    def failure(self) -> str:
        """Why it exited, in one line: its exit status and its last line of output."""
        if self.pump is not None:
            self.pump.join(timeout=2)  # the last lines may still be in the pipe
        said = f": {self.last_line}" if self.last_line else ""
        return f"{self.name} {self.exit_status()}{said} (log: {self.log_path})"


def launch(
    name: str,
    command: list[str],
    env: dict,
    log_path: Path,
    starts: int = 1,
    says_ready: Callable[[str], bool] | None = None,
) -> Child:
    if preload_client.preloaded_module(command):
        proc = preload_client.start(command, env)
    else:
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=die_with_parent,
            text=True,
            start_new_session=True,
        )
    child = Child(name, proc, log_path=log_path, command=command, env=env, starts=starts)
    if says_ready is not None:
        child.says_ready = says_ready
    child.pump = threading.Thread(target=_pump, args=(child,), daemon=True)
    child.pump.start()
    return child


def _pump(child: Child) -> None:
    with open(child.log_path, "a" if child.starts > 1 else "w") as log:
        for line in child.proc.stdout:
            log.write(line)
            log.flush()
            if line.strip():
                child.last_line = line.strip()
            if child.says_ready(line):
                child.ready_line = line.strip()
                child.ready.set()


def wait_ready(
    children: list[Child], deadline: float, cancel: threading.Event | None = None
) -> None:
    """Until every child said it is ready; raises when one exits, the deadline
    passes or `cancel` is set."""
    for child in children:
        while not child.ready.wait(timeout=0.1):
            if cancel is not None and cancel.is_set():
                raise StartCancelled(f"stopped while {child.name} was starting")
            if child.proc.poll() is not None:
                raise RuntimeError(child.failure())
            if time.monotonic() > deadline:
                raise TimeoutError(f"{child.name} not ready in time; see {child.log_path}")
