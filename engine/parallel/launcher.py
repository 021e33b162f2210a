"""Rank 0's side of a parallel engine: it starts one process per other rank
(`python -m engine.parallel.follower`), joins the process group with them, and
watches them. A rank that dies makes the engine unusable (its peers would wait
on it): `on_failure` is called once (a worker process exits, so its streams
move to another worker), and every later step fails."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from basis import preload_client
from basis.preload import die_with_parent
from engine.parallel import state as parallel_state
from engine.parallel import step_wire

logger = logging.getLogger(__name__)


def config_options(config) -> dict:
    """An EngineConfig as the options a follower rebuilds it from."""
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def _die_with_parent() -> None:
    """A rank outlives no engine: SIGKILL when rank 0's process ends (Linux)."""
    die_with_parent(signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Followers:
    def __init__(self, options: dict, model_dir: str | Path, tp: int, pp: int, device):
        self.device = torch.device(device)
        self.store = f"127.0.0.1:{_free_port()}"
        self.on_failure: Callable[[str], None] | None = None
        self.failed: str | None = None
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, tp * pp):
            env = dict(os.environ)
            if self.device.type == "cuda":  # one GPU per rank, its own first
                visible = env.get("CUDA_VISIBLE_DEVICES", "")
                ids = visible.split(",") if visible else [str(i) for i in range(tp * pp)]
                env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[rank:] + ids[:rank])
            command = [sys.executable, "-m", "engine.parallel.follower", "--rank", str(rank),
                       "--tp", str(tp), "--pp", str(pp), "--store", self.store,
                       "--model", str(model_dir), "--options", json.dumps(options)]  # fmt: skip
            if preload_client.preloaded_module(command):  # its output where ours goes
                self.procs.append(preload_client.start(command, env, outputs=(1, 2)))
            else:
                self.procs.append(subprocess.Popen(command, env=env, start_new_session=True,
                                                   preexec_fn=_die_with_parent))  # fmt: skip
        parallel_state.initialize(tp, pp, 0, self.store, self.device)
        self.sender = step_wire.StepSender(tp * pp)
        self._stop = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="rank-watch").start()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            for rank, proc in enumerate(self.procs, 1):
                code = proc.poll()
                if code is not None and self.failed is None:
                    self.failed = f"tensor/pipeline rank {rank} exited with {code}"
                    logger.error("%s: the engine cannot step any more", self.failed)
                    if self.on_failure is not None:
                        self.on_failure(self.failed)

    def stats(self) -> list[list[float]]:
        """(busy seconds, collective seconds, steps) of ranks 1.. in order."""
        return self.sender.stats(self.device)

    def send(self, shape, d64, d32) -> None:
        """A step to every other rank (which run it as rank 0 does)."""
        if self.failed is not None:
            raise RuntimeError(self.failed)
        self.sender.send(shape, d64, d32)

    def close(self) -> None:
        self._stop.set()
        if self.failed is None:
            try:
                self.sender.stop(self.device)
            except Exception:  # noqa: BLE001 - a rank gone already; kill below
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        parallel_state.shutdown()
