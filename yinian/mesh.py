"""The whole mesh on one machine: NATS, Redis, the KV store, the scheduler,
workers and gateways as child processes (yinian/children.py), started in order
and each waited for until it says it is ready; any of them can be killed and
started again as it was (same ports). Used by `yinian up` (under its
supervisor), the tests and the reliability benchmarks.
"""

from __future__ import annotations

import os
import secrets
import signal
import ssl
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from basis.host_regions import default_store_memory_bytes
from services.common import callers, mesh_token
from services.common.processes import (
    check_port_free,
    free_port,
    nats_server_binary,
    redis_command,
    redis_env,
    redis_server_binary,
    stop_processes,
)
from services.common.tls import TlsFiles
from services.kvstore import block_key
from yinian import mps, nats_users
from yinian.children import Child, StartCancelled, launch, wait_ready
from yinian.mps import MpsDaemon

INFRASTRUCTURE = ("nats", "redis")  # stopped after the services, which talk to them
GPU_ROLES = ("colocated", "decode", "prefill", "expert")  # the roles that hold a GPU


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
    gateways: int = 1  # the first on `port`/`grpc_port`, the others on free ports
    tls: TlsFiles | None = None  # every service's certificate, key and CA (mutual TLS)
    # internal calls unauthenticated (no mesh token: services/common/mesh_token.py)
    insecure_internal: bool = False
    drain_timeout: float = 30.0  # a stopped worker's time to finish its streams
    # The KV store (the shared tier) and the Redis behind it: started here unless
    # `redis_url` names one; without any redis-server the store has no tier and the
    # workers' host tiers still work.
    kvstore: bool = False
    redis_url: str | None = None
    kvstore_argv: list[str] = field(default_factory=list)
    # MoE expert services (services/expert); with any, workers compute their routed
    # experts there (--expert-parallel) once the scheduler's balancer placed them.
    experts: int = 0
    expert_argv: list[str] = field(default_factory=list)
    # the GPU services as clients of an MPS daemon of the mesh's own (yinian/mps.py):
    # auto = where expert services share the workers' GPU
    mps: str = "auto"
    # colocated workers it may grow to (`add_worker`, the planner of `yinian up`): each
    # gets its NATS login when NATS starts
    max_workers: int = 0


class Mesh:
    def __init__(self, spec: MeshSpec):
        self.spec = spec
        self.children: list[Child] = []
        self.nats_url = spec.nats_url
        # each service's own NATS URL (its login: yinian/nats_users.py), when the mesh
        # starts its NATS with logins; the others use `nats_url`
        self.service_nats_urls: dict[str, str] = {}
        # the key tagging the mesh's blocks in Redis: one per mesh, kept by the store's
        # restarts, unless one is given
        self.block_key = (spec.env.get(block_key.ENV) or os.environ.get(block_key.ENV)
                          or block_key.new_key())  # fmt: skip
        self.redis_url = spec.redis_url  # the mesh owner's login, on a Redis it starts
        self.kvstore_redis_url: str | None = None  # the KV store's own login there
        self.gateway_ports: list[tuple[int, int]] = []  # (REST, gRPC) of each gateway
        self.kvstore_address = ""
        self.scheduler_address = ""
        self._grpc_port = spec.grpc_port or 0  # 0: any free port, read back once it is bound
        self._credentials: dict[str, str] = {}  # each service's own (services/common/callers.py)
        self.log_dir = spec.log_dir or Path(os.environ.get("TMPDIR", "/tmp")) / (
            f"yinian-{os.getpid()}-{int(time.time())}"
        )
        self.mps: MpsDaemon | None = None
        self._gpu_env: dict[str, str] = {}  # the MPS clients' environment, when it runs

    @property
    def url(self) -> str:
        return self.urls[0]

    @property
    def urls(self) -> list[str]:
        """Each gateway's REST address (the ports it bound, once started)."""
        scheme = "https" if self.spec.tls else "http"
        ports = self.gateway_ports or [(self.spec.port, self._grpc_port)]
        return [f"{scheme}://{self.spec.host}:{rest}" for rest, _ in ports]

    def ssl_context(self) -> ssl.SSLContext | None:
        """What a REST client of a TLS mesh verifies the gateways with."""
        tls = self.spec.tls
        return ssl.create_default_context(cafile=tls.ca or None) if tls else None

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
        # with logins, a service has its own (a gateway reads the load reports and KV
        # events to place requests itself) or none: never the owner's
        nats_url = self.service_nats_urls.get(name) if self.service_nats_urls else self.nats_url
        given = any(a == "--nats-url" or a.startswith("--nats-url=") for a in argv)
        if nats_url is None and module != "services.gateway" and not given:
            # it would talk to the default NATS URL: another NATS, or none
            raise ValueError(f"{name} has no NATS login in this mesh (see MeshSpec.max_workers)")
        if nats_url:  # with its password: by environment, never on a command line
            env["YINIAN_NATS_URL"] = nats_url
        env.pop(callers.ENV, None)
        if self.spec.insecure_internal:
            env.pop(mesh_token.ENV, None)
        else:
            env.update(self._credential_env(name))
        if self.spec.tls is not None:  # every service's TlsSettings read these
            tls = self.spec.tls
            env.update(YINIAN_TLS_CERT=tls.cert, YINIAN_TLS_KEY=tls.key, YINIAN_TLS_CA=tls.ca)
        if role in GPU_ROLES:
            env.update(self._gpu_env)
        env.update(self.spec.role_env.get(role, {}))
        env.update(extra or {})
        return self._add(launch(name, [sys.executable, "-m", module, *argv], env,
                                self.log_dir / f"{name}.log"))  # fmt: skip

    def _credential_env(self, name: str) -> dict[str, str]:
        """A service's own credential and the table of its mesh's callers. This process
        is the meshes' owner (one credential for all of them); a shared secret already in
        its environment (no `NAME.` in it) goes to every service instead."""
        owner = os.environ.setdefault(mesh_token.ENV, callers.new_credential(callers.OWNER))
        if not owner.startswith(f"{callers.OWNER}."):
            return {mesh_token.ENV: owner}
        self._credentials[callers.OWNER] = owner
        mine = self._credentials.setdefault(name, callers.new_credential(name))
        table = self.log_dir / "callers"
        callers.write_table(table, self._credentials)
        return {mesh_token.ENV: mine, callers.ENV: str(table)}

    def _add(self, child: Child) -> Child:
        self.children.append(child)
        return child

    def relaunch(self, name: str) -> Child:
        """Starts a child again with its first command (stopping it first if it still
        runs; a worker drains); returns at once, `wait_ready` waits. Its log continues."""
        old = self.child(name)
        stop_processes([old.proc], timeout=self.spec.drain_timeout + 10)
        new = launch(name, old.command, old.env, old.log_path, old.starts + 1, old.says_ready)
        self.children[self.children.index(old)] = new
        return new

    def respawn(self, name: str, timeout: float = 120.0) -> Child:
        """`relaunch`, then waits until it is ready."""
        new = self.relaunch(name)
        wait_ready([new], time.monotonic() + timeout)
        return new

    def add_worker(self) -> Child:
        """Starts one more colocated worker (the lowest free `worker-N`); `wait_worker`
        waits for it. It registers with the scheduler and is placed on once ready."""
        taken = {c.name for c in self.children}
        index = next(i for i in range(len(taken) + 1) if f"worker-{i}" not in taken)
        name = f"worker-{index}"
        if self.service_nats_urls and name not in self.service_nats_urls:
            raise ValueError(f"{name}: beyond the mesh's max_workers ({self.spec.max_workers})")
        workers = sum(c.name.startswith(("worker-", "prefill-", "decode-")) for c in self.children)
        return self._spawn(name, "services.decode", self.worker_args(name, "colocated"),
                           "colocated", self.gpu_env(workers))  # fmt: skip

    def wait_worker(self, child: Child, timeout: float = 300.0) -> None:
        """Waits until an added worker is ready (a restart then keeps its ports); one
        that fails to start is stopped and left out."""
        try:
            wait_ready([child], time.monotonic() + timeout)
        except BaseException:
            if child in self.children:
                self.remove_worker(child.name)
            raise
        _pin_worker(child)

    def remove_worker(self, name: str) -> None:
        """Stops a worker for good (not restarted): SIGTERM, it drains its streams (those
        left after the drain timeout move to other workers), then it is gone."""
        child = self.child(name)
        self.children.remove(child)
        stop_processes([child.proc], timeout=self.spec.drain_timeout + 10)

    def _start_nats(self) -> Child:
        # -p -1: any free port, which its "Listening ... on HOST:PORT" line names
        command = [nats_server_binary(), "-a", "127.0.0.1", "-p", "-1"]
        if not self.spec.insecure_internal:  # logins, in a file only we read
            self._nats_logins = [nats_users.operator_login()] + [
                nats_users.service_login(name) for name in self.service_names()
            ]
            conf = _private_file(self.log_dir / "nats.conf",
                                 nats_users.server_config(self._nats_logins))  # fmt: skip
            command += ["-c", str(conf)]
        listening = lambda line: "Listening for client" in line  # noqa: E731
        return self._add(launch("nats", command, dict(os.environ), self.log_dir / "nats.log",
                                says_ready=listening))  # fmt: skip

    def _start_redis(self) -> Child | None:
        binary = redis_server_binary()
        if binary is None:
            return None
        port = free_port()
        data_dir = tempfile.mkdtemp(prefix="yinian-redis-", dir=self.log_dir)
        conf = None
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        if not self.spec.insecure_internal:  # ACL users, in a file only we read
            operator, store = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
            conf = _private_file(Path(data_dir) / "redis.conf", redis_users(operator, store))
            self.redis_url = f"redis://yinian:{operator}@127.0.0.1:{port}/0"
            self.kvstore_redis_url = f"redis://kvstore:{store}@127.0.0.1:{port}/0"
        command = redis_command(binary, port, data_dir, config=str(conf) if conf else None)
        return self._add(launch("redis", command, redis_env(),
                                self.log_dir / "redis.log",
                                says_ready=lambda line: "Ready to accept" in line))  # fmt: skip

    def _placed(self) -> list[tuple[str, str, str, int]]:
        """(name prefix, role, service module, index) of each worker the spec asks for."""
        roles = [
            ("worker", "colocated", "decode", self.spec.workers),
            ("prefill", "prefill", "prefill", self.spec.prefill),
            ("decode", "decode", "decode", self.spec.decode),
        ]
        return [(p, role, m, i) for p, role, m, count in roles for i in range(count)]

    def service_names(self) -> list[str]:
        """The services of this mesh that speak on NATS, by the names it gives them."""
        spare = range(self.spec.workers, self.spec.max_workers)
        gateways = ["gateway"] + [f"gateway-{i}" for i in range(1, self.spec.gateways)]
        return (["scheduler"] + (["kvstore"] if self.spec.kvstore else [])
                + gateways[: self.spec.gateways]
                + [f"{prefix}-{i}" for prefix, _, _, i in self._placed()]
                + [f"worker-{i}" for i in spare]
                + [f"expert-{i}" for i in range(self.spec.experts)])  # fmt: skip

    def worker_args(self, worker_id: str, role: str) -> list[str]:
        """Flags of a worker: the prefill service has one role; the decode service
        takes `--role colocated|decode`."""
        return [
            "--model",
            self.spec.model,
            "--scheduler",
            self.scheduler_address,
            "--worker-id",
            worker_id,
            *([] if role == "prefill" else ["--role", role]),
            "--host",
            self.spec.host,
            *(["--kvstore", self.kvstore_address] if self.kvstore_address else []),
            *(["--expert-parallel"] if self.spec.experts else []),
            "--drain-timeout",
            str(self.spec.drain_timeout),
            *self.spec.engine_argv,
            *self.spec.worker_argv,
            *self.spec.role_argv.get(role, []),
        ]

    def start(self, timeout: float = 120.0, cancel: threading.Event | None = None) -> Mesh:
        """Starts everything in order; setting `cancel` stops the start-up at once
        (StartCancelled), and whatever was started is stopped."""
        deadline = time.monotonic() + timeout
        self.check_ports()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            if not self.nats_url:
                nats = self._start_nats()
                wait_ready([nats], deadline, cancel)
                port = _pin(nats, "-p", nats.ready_line.rsplit(":", 1)[-1])
                address = f"127.0.0.1:{port}"
                self.nats_url = f"nats://{address}"
                if not self.spec.insecure_internal:
                    operator, *services = self._nats_logins
                    self.nats_url = nats_users.url_of(operator, address)
                    self.service_nats_urls = {
                        login.user: nats_users.url_of(login, address) for login in services
                    }
            # Every service binds any free port and names it in its ready line: no port is
            # picked here and released for a child to take (another process may take it
            # first). A restart is pinned to the port its first start bound.
            scheduler = self._spawn(
                "scheduler",
                "services.scheduler",
                ["--host", self.spec.host, "--port", "0",
                 *([] if self.spec.experts else ["--no-expert-balancer"]),
                 *self.spec.scheduler_argv],
            )  # fmt: skip
            started = [scheduler]
            if self.spec.kvstore:
                started.append(self._start_kvstore(deadline, cancel))
            wait_ready(started, deadline, cancel)
            self.scheduler_address = _bound_address(scheduler)
            if self.spec.kvstore:
                self.kvstore_address = _bound_address(started[-1])
            self._start_mps()
            placed = self._placed()
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
            workers += [self._spawn_expert(i) for i in range(self.spec.experts)]
            gateways = [self._spawn_gateway(i) for i in range(self.spec.gateways)]
            wait_ready([*workers, *gateways], deadline, cancel)
            for child in workers:  # a restarted worker comes back on the same ports
                _pin_worker(child)
            self.gateway_ports = [_bound_gateway(g) for g in gateways]
            for url in self.urls[: self.spec.gateways]:  # none: a mesh of back ends only
                self._wait_healthy(url, deadline, cancel)
        except BaseException:
            self.stop()
            raise
        return self

    def check_ports(self) -> None:
        """The first gateway's fixed ports must be free (a StartupError naming the port)."""
        if self.spec.gateways:
            check_port_free(self.spec.host, self.spec.port, "REST")
            check_port_free(self.spec.host, self._grpc_port, "gRPC")

    def _start_mps(self) -> None:
        if not mps.wanted(self.spec.mps, self.spec.experts, self.spec.engine_argv):
            return
        daemon = mps.MpsDaemon(self.log_dir)
        try:
            self._gpu_env = daemon.start()
            self.mps = daemon
        except RuntimeError as exc:
            if self.spec.mps == "on":
                raise
            print(f"the GPU services run without MPS: {exc}", flush=True)

    def _spawn_gateway(self, index: int) -> Child:
        ports = (self.spec.port, self._grpc_port) if index == 0 else (0, 0)
        argv = ["--model", self.spec.model, "--host", self.spec.host, "--port", str(ports[0]),
                "--grpc-port", str(ports[1]), "--scheduler", self.scheduler_address]  # fmt: skip
        name = "gateway" if index == 0 else f"gateway-{index}"
        return self._spawn(name, "services.gateway", [*argv, *self.spec.gateway_argv], "gateway")

    def _spawn_expert(self, index: int) -> Child:
        argv = ["--model", self.spec.model, "--host", self.spec.host, "--scheduler",
                self.scheduler_address, "--expert-id",
                f"expert-{index}", *self.spec.expert_argv]  # fmt: skip
        return self._spawn(f"expert-{index}", "services.expert", argv, "expert")

    def _start_kvstore(self, deadline: float, cancel: threading.Event | None) -> Child:
        if self.redis_url is None:
            redis = self._start_redis()
            if redis is None:
                self.redis_url = ""
                print("no redis-server found: the shared KV tier is off (host tiers only)",
                      flush=True)  # fmt: skip
            else:
                wait_ready([redis], deadline, cancel)
        argv = ["--host", self.spec.host, "--port", "0"]
        store_url = self.kvstore_redis_url or self.redis_url  # its own login, if it has one
        extra = {"YINIAN_REDIS_URL": store_url} if self.redis_url else {}
        if "--memory-tier-bytes" not in self.spec.kvstore_argv:
            argv += ["--memory-tier-bytes", str(default_store_memory_bytes())]
        return self._spawn("kvstore", "services.kvstore", [*argv, *self.spec.kvstore_argv],
                           extra={block_key.ENV: self.block_key, **extra})  # fmt: skip

    def kill_redis(self) -> None:
        """SIGKILL the mesh's Redis (a crash, for tests); `restart_redis` brings it back."""
        self.kill("redis")

    def restart_redis(self) -> None:
        """A fresh, empty Redis on the same port."""
        self.respawn("redis", timeout=10)

    def _wait_healthy(self, url: str, deadline: float, cancel: threading.Event | None) -> None:
        while not (cancel is not None and cancel.is_set()):
            try:
                with urllib.request.urlopen(
                    f"{url}/health", timeout=2, context=self.ssl_context()
                ) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"gateway not healthy in time; logs in {self.log_dir}")
            time.sleep(0.1)
        raise StartCancelled("stopped while waiting for the gateway to be ready")

    @property
    def grpc_port(self) -> int:
        """The first gateway's gRPC port (as bound, once started)."""
        return self.gateway_ports[0][1] if self.gateway_ports else self._grpc_port

    def metrics_endpoints(self) -> dict[str, str]:
        """Each service's Prometheus endpoint: the gateways' /metrics, and what the
        others' ready lines name ("... metrics HOST:PORT")."""
        scheme = "https" if self.spec.tls is not None else "http"
        out = {}
        for child in self.children:
            words = child.ready_line.split()
            if "metrics" in words[:-1]:
                out[child.name] = f"http://{words[words.index('metrics') + 1]}/metrics"
        for i, (rest, _) in enumerate(self.gateway_ports):
            out["gateway" if i == 0 else f"gateway-{i}"] = (
                f"{scheme}://{self.spec.host}:{rest}/metrics"
            )
        return out

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def kill(self, name: str) -> None:
        """SIGKILL one child (a crash, for tests)."""
        child = self.child(name)
        os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait(timeout=10)

    def stop(self) -> None:
        """Stops the services together, then NATS and Redis."""
        services = [c.proc for c in self.children if c.name not in INFRASTRUCTURE]
        stop_processes(services)
        if self.mps is not None:
            self.mps.stop()
        stop_processes([c.proc for c in self.children if c.name in INFRASTRUCTURE])

    def __enter__(self) -> Mesh:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def redis_users(operator: str, store: str) -> str:
    """The ACL of the Redis `yinian up` starts: no anonymous user; the mesh's owner
    (tools, tests) with every key; the KV store with its own keys (`yinian:kv:*`)
    and no administrative command (no FLUSHALL, CONFIG, KEYS, DEBUG, ...)."""
    return (
        "user default off\n"
        f"user yinian on >{operator} ~* &* +@all\n"
        f"user kvstore on >{store} ~yinian:kv:* &* +@all -@dangerous\n"
    )


def _private_file(path: Path, text: str) -> Path:
    """`text` in a file only this user may read (a secret for a child's config)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def _pin(child: Child, flag: str, port) -> int:
    """Writes the port a child bound into its command (after `flag`), so that a
    restart binds the same one; returns it."""
    command = child.command
    command[command.index(flag) + 1] = str(port)
    return int(port)


def _bound_address(child: Child) -> str:
    """HOST:PORT from a ready line "READY <kind> HOST:PORT ...", pinned for restarts."""
    address = child.ready_line.split()[2]
    _pin(child, "--port", address.rsplit(":", 1)[-1])
    return address


def _pin_worker(child: Child) -> None:
    """A worker's or expert service's ports, from "READY <kind> <id> HOST:PORT metrics
    HOST:PORT", written into its command (last, so they win) for its restarts."""
    words = child.ready_line.split()
    for flag, address in (("--port", words[3]), ("--metrics-port", words[5])):
        port = address.rsplit(":", 1)[-1]
        if flag in child.command:
            _pin(child, flag, port)
        else:
            child.command += [flag, port]


def _bound_gateway(child: Child) -> tuple[int, int]:
    """(REST, gRPC) ports from "READY gateway SCHEME://HOST:PORT grpc HOST:PORT", pinned."""
    words = child.ready_line.split()
    rest = _pin(child, "--port", words[2].rsplit(":", 1)[-1])
    return rest, _pin(child, "--grpc-port", words[4].rsplit(":", 1)[-1])
