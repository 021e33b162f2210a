"""The whole mesh on one machine: NATS, the scheduler, workers and the
gateway as child processes, started in order and each waited for until it
says it is ready. Used by `yinian up` and by the tests.

Children die with the launcher (Linux parent-death signal), so even a killed
launcher leaves no process behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from services.common.processes import free_port, start_nats, start_redis, stop_process


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    ready: threading.Event = field(default_factory=threading.Event)
    ready_line: str = ""
    log_path: Path | None = None
    command: list[str] = field(default_factory=list)  # to start it again
    env: dict[str, str] = field(default_factory=dict)
    starts: int = 1


@dataclass
class MeshSpec:
    model: str
    workers: int = 1
    prefill: int = 0
    decode: int = 0
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int | None = None
    nats_url: str | None = None
    engine_argv: list[str] = field(default_factory=list)
    gateway_argv: list[str] = field(default_factory=list)
    scheduler_argv: list[str] = field(default_factory=list)
    worker_argv: list[str] = field(default_factory=list)
    role_argv: dict[str, list[str]] = field(default_factory=dict)  # extra flags per role
    env: dict[str, str] = field(default_factory=dict)
    # Extra environment per role, e.g. {"decode": {"CUDA_VISIBLE_DEVICES": "1,0"}} puts
    # the decode workers on the second GPU while both GPUs stay visible (NCCL peers).
    role_env: dict[str, dict[str, str]] = field(default_factory=dict)
    # GPUs to spread the workers over (colocated, then prefill, then decode), one each in
    # turn; each worker sees all of them, its own first, so NCCL and CUDA IPC reach peers.
    gpus: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    # The KV store (shared tier + global index) and the Redis behind it: started here
    # unless `redis_url` names one; without any redis-server the store runs the
    # index only (host tiers still work).
    kvstore: bool = False
    redis_url: str | None = None
    kvstore_argv: list[str] = field(default_factory=list)


class Mesh:
    def __init__(self, spec: MeshSpec):
        self.spec = spec
        self.children: list[Child] = []
        self.nats_proc: subprocess.Popen | None = None
        self.nats_url = spec.nats_url
        self.redis_proc: subprocess.Popen | None = None
        self.redis_url = spec.redis_url
        self.kvstore_address = ""
        self.scheduler_address = ""
        self.grpc_port = spec.grpc_port or free_port()
        self.log_dir = spec.log_dir or Path(os.environ.get("TMPDIR", "/tmp")) / (
            f"yinian-{os.getpid()}-{int(time.time())}"
        )

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    def gpu_env(self, index: int) -> dict[str, str]:
        """CUDA_VISIBLE_DEVICES for the index-th worker: its GPU first, then the rest."""
        gpus = self.spec.gpus
        if not gpus:
            return {}
        k = index % len(gpus)
        return {"CUDA_VISIBLE_DEVICES": ",".join(gpus[k:] + gpus[:k])}

    def _spawn(
        self, name: str, module: str, argv: list[str], role: str = "", extra: dict | None = None
    ) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.spec.env)
        env.update(self.spec.role_env.get(role, {}))
        env.update(extra or {})
        child = self._launch(name, [sys.executable, "-m", module, *argv], env)
        self.children.append(child)
        return child

    def _launch(self, name: str, command: list[str], env: dict, starts: int = 1) -> Child:
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent,
            text=True,
            start_new_session=True,
        )
        child = Child(name, proc, log_path=self.log_dir / f"{name}.log", command=command,
                      env=env, starts=starts)  # fmt: skip
        threading.Thread(target=self._pump, args=(child,), daemon=True).start()
        return child

    def respawn(self, name: str, timeout: float = 120.0) -> Child:
        """Starts a child again with its first command (stopping it first if it still
        runs) and waits until it is ready; its log continues."""
        old = self.child(name)
        stop_process(old.proc)
        new = self._launch(name, old.command, old.env, old.starts + 1)
        self.children[self.children.index(old)] = new
        self._wait([new], time.monotonic() + timeout)
        return new

    @staticmethod
    def _pump(child: Child) -> None:
        with open(child.log_path, "a" if child.starts > 1 else "w") as log:
            for line in child.proc.stdout:
                log.write(line)
                log.flush()
                if line.startswith("READY "):
                    child.ready_line = line.strip()
                    child.ready.set()

    def _wait(self, children: list[Child], deadline: float) -> None:
        for child in children:
            while not child.ready.wait(timeout=0.1):
                if child.proc.poll() is not None:
                    raise RuntimeError(
                        f"{child.name} exited with {child.proc.returncode}; see {child.log_path}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{child.name} not ready in time; see {child.log_path}")

    def worker_args(self, worker_id: str, role: str) -> list[str]:
        """Flags of a worker: the prefill service has one role; the decode service
        takes `--role colocated|decode`."""
        return [
            "--model",
            self.spec.model,
            "--scheduler",
            self.scheduler_address,
            "--nats-url",
            self.nats_url,
            "--worker-id",
            worker_id,
            *([] if role == "prefill" else ["--role", role]),
            "--host",
            self.spec.host,
            *(["--kvstore", self.kvstore_address] if self.kvstore_address else []),
            *self.spec.engine_argv,
            *self.spec.worker_argv,
            *self.spec.role_argv.get(role, []),
        ]

    def start(self, timeout: float = 120.0) -> Mesh:
        deadline = time.monotonic() + timeout
        try:
            if not self.nats_url:
                self.nats_proc, self.nats_url = start_nats()
            sched_port = free_port()
            self.scheduler_address = f"{self.spec.host}:{sched_port}"
            scheduler = self._spawn(
                "scheduler",
                "services.scheduler",
                [
                    "--host",
                    self.spec.host,
                    "--port",
                    str(sched_port),
                    "--nats-url",
                    self.nats_url,
                    *self.spec.scheduler_argv,
                ],
            )
            started = [scheduler]
            if self.spec.kvstore:
                started.append(self._start_kvstore())
            self._wait(started, deadline)
            roles = [
                ("worker", "colocated", "decode", self.spec.workers),
                ("prefill", "prefill", "prefill", self.spec.prefill),
                ("decode", "decode", "decode", self.spec.decode),
            ]
            placed = [(p, role, m, i) for p, role, m, count in roles for i in range(count)]
            workers = [
                self._spawn(
                    f"{prefix}-{i}",
                    f"services.{module}",
                    self.worker_args(f"{prefix}-{i}", role),
                    role,
                    self.gpu_env(n),
                )
                for n, (prefix, role, module, i) in enumerate(placed)
            ]
            gateway = self._spawn(
                "gateway",
                "services.gateway",
                [
                    "--model",
                    self.spec.model,
                    "--host",
                    self.spec.host,
                    "--port",
                    str(self.spec.port),
                    "--grpc-port",
                    str(self.grpc_port),
                    "--scheduler",
                    self.scheduler_address,
                    *self.spec.gateway_argv,
                ],
            )
            self._wait([*workers, gateway], deadline)
            self._wait_healthy(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_kvstore(self) -> Child:
        if self.redis_url is None:
            try:
                self.redis_proc, self.redis_url = start_redis()
            except FileNotFoundError:
                self.redis_url = ""
                print("no redis-server found: the shared KV tier is off (host tiers only)",
                      flush=True)  # fmt: skip
        port = free_port()
        self.kvstore_address = f"{self.spec.host}:{port}"
        argv = ["--host", self.spec.host, "--port", str(port), "--nats-url", self.nats_url]
        if self.redis_url:
            argv += ["--redis-url", self.redis_url]
        return self._spawn("kvstore", "services.kvstore", [*argv, *self.spec.kvstore_argv])

    def kill_redis(self) -> None:
        """SIGKILL the mesh's Redis (a crash, for tests); `restart_redis` brings it back."""
        os.killpg(self.redis_proc.pid, signal.SIGKILL)
        self.redis_proc.wait(timeout=10)

    def restart_redis(self) -> None:
        """A fresh, empty Redis on the same port."""
        port = int(self.redis_url.rsplit(":", 1)[1].split("/")[0])
        self.redis_proc, _ = start_redis(port)

    def _wait_healthy(self, deadline: float) -> None:
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"gateway not healthy in time; logs in {self.log_dir}")
            time.sleep(0.1)

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def kill(self, name: str) -> None:
        """SIGKILL one child (a crash, for tests)."""
        child = self.child(name)
        os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait(timeout=10)

    def stop(self) -> None:
        for child in reversed(self.children):
            stop_process(child.proc)
        for attr in ("nats_proc", "redis_proc"):
            proc = getattr(self, attr)
            if proc is not None:
                stop_process(proc)
                setattr(self, attr, None)

    def __enter__(self) -> Mesh:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
