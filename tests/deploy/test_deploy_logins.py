"""The NATS and Redis of deploy/ (compose and k8s) ask for the passwords of the
mesh's Secret: their start scripts, run here with the local nats-server and
redis-server in their place, refuse an anonymous client once the password is
set, and the services (which add `YINIAN_NATS_PASSWORD` / `YINIAN_REDIS_PASSWORD`
to their URLs) get in; unset, both stay open as before. The Redis health check
passes with the password."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import nats
import pytest
import redis
import yaml
from paths import ROOT

from basis.urls import NATS_PASSWORD_ENV, REDIS_PASSWORD_ENV, with_login
from services.common.bus import EventBus
from services.common.processes import free_port, nats_server_binary, redis_server_binary

DEPLOY = ROOT / "deploy"
PASSWORD = "s3cret-Pass"


def _scripts(name: str) -> tuple[str, str]:
    """The `sh -c` script of the compose service and of the k8s container `name`."""
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    script = compose["services"][name]["entrypoint"][2].replace("$$", "$")  # compose's escape
    docs = yaml.safe_load_all((DEPLOY / "k8s" / "base" / f"{name}.yaml").read_text())
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    return script, pod["containers"][0]["command"][2]


def _run(script: str, password: str | None, ready) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in (NATS_PASSWORD_ENV, REDIS_PASSWORD_ENV)}
    if password is not None:
        env[NATS_PASSWORD_ENV] = env[REDIS_PASSWORD_ENV] = password
    proc = subprocess.Popen(["sh", "-c", script], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 20
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, "did not start"
        time.sleep(0.1)
    return proc


async def _nats_client(url: str) -> None:
    client = await nats.connect(url, connect_timeout=3, allow_reconnect=False,
                                max_reconnect_attempts=0)  # fmt: skip
    await client.close()


def _nats_up(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("password", [PASSWORD, None], ids=["with password", "without"])
def test_deployed_nats_takes_only_the_meshs_login(tmp_path, monkeypatch, password):
    compose, k8s = _scripts("nats")
    assert compose == k8s
    port, monitor = free_port(), free_port()
    script = compose.replace("exec nats-server", f"exec {nats_server_binary()} -a 127.0.0.1 "
                             f"-p {port}").replace("/data", str(tmp_path)).replace(
                             "-m 8222", f"-m {monitor}")  # fmt: skip
    proc = _run(script, password, lambda: _nats_up(port))
    try:
        url = f"nats://127.0.0.1:{port}"
        if password:
            with pytest.raises(Exception, match="(?i)authorization"):
                asyncio.run(_nats_client(url))
            monkeypatch.setenv(NATS_PASSWORD_ENV, password)
        else:
            asyncio.run(_nats_client(url))  # open, as the compose file says when unset
        bus = EventBus(url, "probe")  # what every service does with its URL
        assert bus.url.startswith("nats://yinian:") == bool(password)

        async def connect():
            await bus.connect(timeout=3)
            await bus.close()

        asyncio.run(connect())
    finally:
        proc.terminate()
        proc.wait(10)


def test_deployed_redis_takes_only_the_password(tmp_path, monkeypatch):
    compose, k8s = _scripts("redis")
    assert compose == k8s
    binary = redis_server_binary()
    if binary is None:
        pytest.skip("no redis-server")
    port = free_port()
    script = compose.replace("exec docker-entrypoint.sh redis-server",
                             f"exec {binary} --bind 127.0.0.1 --port {port} "
                             f"--dir {tmp_path}")  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"

    def up() -> bool:
        try:
            redis.Redis.from_url(url).ping()
        except redis.AuthenticationError:
            return True
        except redis.ConnectionError:
            return False
        return True

    proc = _run(script, PASSWORD, up)
    try:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url).set("yinian:kv:x", b"1")
        monkeypatch.setenv(REDIS_PASSWORD_ENV, PASSWORD)
        assert redis.Redis.from_url(with_login(url, REDIS_PASSWORD_ENV)).ping()
        compose_check = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
        check = compose_check["services"]["redis"]["healthcheck"]["test"][1].replace("$$", "$")
        cli_dir = str(Path(binary).parent)
        env = dict(os.environ, PATH=f"{cli_dir}:{os.environ['PATH']}")
        check = check.replace("redis-cli ping", f"redis-cli -p {port} ping")
        assert subprocess.run(["sh", "-c", check], env=env, timeout=10).returncode == 0
        env.pop(REDIS_PASSWORD_ENV)
        assert subprocess.run(["sh", "-c", check], env=env, timeout=10).returncode != 0
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_url_with_its_own_login_keeps_it(monkeypatch):
    monkeypatch.setenv(REDIS_PASSWORD_ENV, "p@ss/word")
    assert with_login("redis://r:6379/0", REDIS_PASSWORD_ENV) == "redis://:p%40ss%2Fword@r:6379/0"
    assert with_login("redis://:mine@r:6379/0", REDIS_PASSWORD_ENV) == "redis://:mine@r:6379/0"
    monkeypatch.setenv(REDIS_PASSWORD_ENV, "")
    assert with_login("redis://r:6379/0", REDIS_PASSWORD_ENV) == "redis://r:6379/0"
