"""An MPS control daemon private to one mesh, for GPU services that share a GPU.

Processes on one GPU without MPS take turns on it: the GPU switches between
their contexts, and a hand-off from one process's kernel to another's costs
~280 us on an H100 (bench/gpu/process_hop.py), against ~20 us when both are
clients of one MPS server, whose kernels run side by side. Expert services next
to their worker hand activations over twice per MoE layer, so `yinian up` runs
the workers and expert services as MPS clients when they share a GPU.

The daemon is a child of the launcher (`-f`, in the foreground: it dies with
it), with its pipe and log folders inside the mesh's log folder, so only this
mesh's services are its clients and no other process on the machine is touched.
The GPU's compute mode and every other setting stay as they are.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from basis.preload import die_with_parent

CONTROL = "nvidia-cuda-mps-control"
MODES = ("auto", "on", "off")


def wanted(mode: str, experts: int, engine_argv: list[str]) -> bool:
    """Whether a mesh runs its GPU services under MPS: `on`, or `auto` with expert
    services beside workers on a CUDA machine (not `--device cpu`)."""
    if mode not in MODES:
        raise ValueError(f"mps must be one of {MODES}, not {mode!r}")
    if mode != "auto":
        return mode == "on"
    on_cpu = any(a == "cpu" and b == "--device" for b, a in zip(engine_argv, engine_argv[1:]))
    return experts > 0 and not on_cpu and os.path.exists("/dev/nvidiactl")


class MpsDaemon:
    """`start()` gives the environment of its clients; `stop()` ends it (and its server)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.env = {
            "CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(folder / "log"),
        }
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 10.0) -> dict[str, str]:
        """Raises RuntimeError where the daemon is missing or does not come up."""
        control = shutil.which(CONTROL)
        if control is None:
            raise RuntimeError(f"{CONTROL} is not on PATH")
        for path in self.env.values():
            os.makedirs(path, exist_ok=True)
        log = open(self.folder / "mps-control.log", "wb")  # noqa: SIM115 - the child's
        self.proc = subprocess.Popen(
            [control, "-f"], env=dict(os.environ, **self.env), stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
        )  # fmt: skip
        log.close()
        socket = Path(self.env["CUDA_MPS_PIPE_DIRECTORY"]) / "control"
        deadline = time.monotonic() + timeout
        while not socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the MPS daemon did not start (see {log.name})")
            time.sleep(0.05)
        return dict(self.env)

    def stop(self) -> None:
        """After its clients have ended: asks the daemon to quit, kills it if it won't."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        control = shutil.which(CONTROL)
        if control is not None:
            try:
                subprocess.run([control], input=b"quit\n", env=dict(os.environ, **self.env),
                               timeout=10, capture_output=True)  # fmt: skip
                proc.wait(timeout=10)
                return
            except (subprocess.TimeoutExpired, OSError):
                pass
        proc.kill()
        proc.wait(timeout=10)
