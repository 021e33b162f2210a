"""A service forked by the preloaded starter runs as `python -m` would run it: its
arguments, environment, working directory, session, output and exit status, and
it does not outlive its starter."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time

import pytest

from basis import preload_client
from basis.preload_client import Starter

PROBE = textwrap.dedent("""
    import os, sys, time
    print("argv", sys.argv[1:])
    print("cwd", os.getcwd())
    print("env", os.environ.get("PROBE_VALUE"), os.environ.get("PROBE_GONE"))
    print("session", os.getsid(0) == os.getpid())
    print("preloaded", "colorsys" in sys.modules)
    print("stdin", repr(sys.stdin.read()))
    print("error line", file=sys.stderr)
    if sys.argv[1] == "wait":
        print("waiting", flush=True)
        time.sleep(120)
    if sys.argv[1] == "interrupt":
        raise KeyboardInterrupt
    if sys.argv[1] == "ending":
        import atexit, threading
        atexit.register(lambda: print("exit handler", flush=True))
        late = lambda: (time.sleep(0.3), print("thread joined", flush=True))
        threading.Thread(target=late).start()
        sys.exit(0)
    sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1])
""")


@pytest.fixture
def starter(tmp_path, monkeypatch):
    (tmp_path / "probe_service.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    env = dict(os.environ, PROBE_GONE="starter's")
    starter = Starter(("colorsys",), env)
    yield starter
    if starter.proc.poll() is None:
        os.killpg(starter.proc.pid, signal.SIGKILL)
    starter.proc.wait(timeout=10)


def _env(**values):
    env = {k: v for k, v in os.environ.items() if k != "PROBE_GONE"}
    return dict(env, **values)


def test_a_forked_service_runs_as_python_m_would(starter, tmp_path):
    proc = starter.spawn(["probe_service", "3", "two words"], _env(PROBE_VALUE="mine"))
    output = proc.stdout.read().splitlines()
    assert proc.wait(timeout=10) == 3
    assert output == [
        "argv ['3', 'two words']",
        f"cwd {tmp_path}",
        "env mine None",  # its own environment, not the starter's
        "session True",
        "preloaded True",
        "stdin ''",
        "error line",
    ]
    assert proc.poll() == 3


def test_output_goes_where_it_is_sent(starter):
    (out_read, out_write), (err_read, err_write) = os.pipe(), os.pipe()
    proc = starter.spawn(["probe_service", "0"], _env(), outputs=(out_write, err_write))
    os.close(out_write)
    os.close(err_write)
    assert proc.stdout is None and proc.wait(timeout=10) == 0
    with os.fdopen(out_read) as out, os.fdopen(err_read) as err:
        assert out.read().splitlines()[0] == "argv ['0']"
        assert err.read() == "error line\n"


def test_a_message_exit_and_a_crash_end_as_in_a_fresh_python(starter):
    said = starter.spawn(["probe_service", "no such number"], _env())
    assert said.stdout.read().splitlines()[-1] == "no such number"
    assert said.wait(timeout=10) == 1
    crashed = starter.spawn(["no_such_service_module"], _env())
    assert "No module named no_such_service_module" in crashed.stdout.read()
    assert crashed.wait(timeout=10) == 1


def test_a_service_ends_as_an_interpreter_does(starter):
    ending = starter.spawn(["probe_service", "ending"], _env())
    assert ending.stdout.read().splitlines()[-2:] == ["thread joined", "exit handler"]
    assert ending.wait(timeout=10) == 0
    interrupted = starter.spawn(["probe_service", "interrupt"], _env())
    assert "KeyboardInterrupt" in interrupted.stdout.read()
    assert interrupted.wait(timeout=10) == -signal.SIGINT


def test_a_request_that_fails_is_refused_and_the_starter_serves_on(starter):
    with pytest.raises(RuntimeError, match="no output attached"):
        starter.spawn(["probe_service", "0"], _env(), outputs=())
    proc = starter.spawn(["probe_service", "5"], _env())
    proc.stdout.read()
    assert proc.wait(timeout=10) == 5


def test_signals_reach_the_service_and_its_status_says_so(starter):
    first = starter.spawn(["probe_service", "wait"], _env())
    second = starter.spawn(["probe_service", "wait"], _env())
    for proc in (first, second):
        while proc.stdout.readline().strip() != "waiting":
            pass
    with pytest.raises(Exception, match="timed out"):
        first.wait(timeout=0.2)
    os.killpg(first.pid, signal.SIGTERM)  # as the launcher stops a service's group
    second.kill()
    assert first.wait(timeout=10) == -signal.SIGTERM
    assert second.wait(timeout=10) == -signal.SIGKILL


def test_services_do_not_outlive_their_starter(starter):
    proc = starter.spawn(["probe_service", "wait"], _env())
    while proc.stdout.readline().strip() != "waiting":
        pass
    os.kill(starter.proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=10) is not None
    deadline = time.monotonic() + 10
    while _alive(proc.pid):  # its parent-death signal ended it
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match="exited"):
        starter.spawn(["probe_service", "0"], _env())


def test_only_the_listed_services_and_only_when_asked(monkeypatch):
    command = [sys.executable, "-m", "services.decode", "--model", "m"]
    with preload_client.preloading(None):  # the environment decides (`yinian up`)
        monkeypatch.setenv(preload_client.ENV, "0")
        assert preload_client.preloaded_module(command) is None
        monkeypatch.setenv(preload_client.ENV, "1")
        assert preload_client.preloaded_module(command) == "services.decode"
    with preload_client.preloading(False):
        assert preload_client.preloaded_module(command) is None
    with preload_client.preloading(True):
        assert preload_client.preloaded_module(command) == "services.decode"
        assert preload_client.preloaded_module([sys.executable, "-m", "http.server"]) is None
        assert preload_client.preloaded_module(["nats-server", "-p", "-1"]) is None


def test_one_starter_serves_whatever_variables_a_service_reads_only_as_it_runs():
    module = "services.scheduler"
    env = dict(os.environ, YINIAN_NATS_URL="nats://a", PYTEST_CURRENT_TEST="a")
    first = preload_client.starter_for(module, env)
    env.update(YINIAN_NATS_URL="nats://b", PYTEST_CURRENT_TEST="b", OTEL_SERVICE_NAME="x")
    assert preload_client.starter_for(module, env) is first
    # one a library may read as it is imported: another starter, imported under it
    other = preload_client.starter_for(module, dict(env, OMP_NUM_THREADS="3"))
    assert other is not first
    proc = preload_client.start([sys.executable, "-m", module, "--help"], env)
    assert "usage" in proc.stdout.read()
    assert proc.wait(timeout=30) == 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False
