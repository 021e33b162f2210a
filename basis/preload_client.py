"""Starting services from a preloaded starter (basis/preload.py) instead of a
fresh `python -m`: with `YINIAN_PRELOAD=1` in the launcher's environment, the
services below start as forks of a process that imported their heavy modules
once. A service so started is the same code with the same arguments,
environment, session and parent-death signal; it is only quicker to start
(about 2.5 s of CPU less for a worker on a small machine). Off by default; the
test suite turns it on (it starts a few hundred services).

A starter is kept per set of modules and per environment (less the variables
the services read only as they run: a library reads some as it is imported), so
a service never runs under imports made with another environment.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

from basis.preload import MAX_MESSAGE, die_with_parent

ENV = "YINIAN_PRELOAD"
# each service module and the modules its starter imports first
# (a rank's module, engine.parallel.follower, is run as __main__ and so not imported
# first: its imports are the decode worker's)
_TORCH = ("basis.grpc_fork", "services.decode.app", "services.prefill.app", "services.expert.app")
_LIGHT = ("basis.grpc_fork", "services.gateway.app", "services.scheduler.app",
          "services.kvstore.app")  # fmt: skip
PRELOADS = {
    "services.decode": _TORCH,
    "services.prefill": _TORCH,
    "services.expert": _TORCH,
    "services.gateway": _LIGHT,
    "services.scheduler": _LIGHT,
    "services.kvstore": _LIGHT,
    "engine.parallel.follower": _TORCH,  # a tensor or pipeline rank
}
# read only while a service runs, never as a module is imported or the interpreter
# starts: a starter serves services whatever these are (pytest names the running test
# in PYTEST_CURRENT_TEST)
_RUNTIME_PREFIXES = ("YINIAN_", "OTEL_", "CUDA_VISIBLE_DEVICES", "PYTEST_")

_starters: dict[tuple, Starter] = {}
_lock = threading.Lock()
_enabled: bool | None = None  # set by `enable`, else the environment decides


def enable(on: bool = True) -> None:
    """Turns preloading on (or off) in this process alone, whatever `YINIAN_PRELOAD` says;
    the processes it starts (`yinian up` in a child) go by their environment."""
    global _enabled
    _enabled = on


@contextlib.contextmanager
def preloading(on: bool | None):
    """Within the block, preloading is `on` in this process; then as it was."""
    global _enabled
    before, _enabled = _enabled, on
    try:
        yield
    finally:
        _enabled = before


def enabled() -> bool:
    if _enabled is not None:
        return _enabled
    return os.environ.get(ENV, "0") not in ("", "0")


def preloaded_module(command: list[str]) -> str | None:
    """The service module `command` runs, where a starter may start it."""
    if not enabled():
        return None
    if len(command) < 3 or command[0] != sys.executable or command[1] != "-m":
        return None
    return command[2] if command[2] in PRELOADS else None


def start(
    command: list[str], env: dict[str, str], outputs: tuple[int, int] | None = None
) -> ForkedProcess:
    """Starts `python -m module args...` (`command`) from its starter; its stdout and
    stderr go to `outputs` (descriptors), else both to a pipe (`.stdout`)."""
    return starter_for(command[2], env).spawn(command[2:], env, outputs)


def starter_for(module: str, env: dict[str, str]) -> Starter:
    """The running starter for `module` under `env`, started if there is none."""
    base = {k: v for k, v in env.items() if not k.startswith(_RUNTIME_PREFIXES)}
    key = (PRELOADS[module], tuple(sorted(base.items())))
    with _lock:
        starter = _starters.get(key)
        if starter is None or not starter.alive():
            starter = _starters[key] = Starter(PRELOADS[module], base)
    return starter


@atexit.register
def _stop_starters() -> None:
    """As this process exits, each starter stops its services' groups and exits (the
    parent-death signal would stop them too, a moment later)."""
    for starter in list(_starters.values()):
        starter.close()


class ForkedProcess:
    """What the launcher holds of a forked service: subprocess.Popen's calls."""

    def __init__(self, pid: int, args: list[str], stdout):
        self.pid, self.args, self.stdout = pid, args, stdout
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Starter:
    """One preloaded starter and the services it forked."""

    def __init__(self, modules: tuple[str, ...], env: dict[str, str]):
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._ids = itertools.count()
        self._asked: dict[int, tuple[Future, list[str], int]] = {}
        self._forked: dict[int, ForkedProcess] = {}
        self._send_lock = threading.Lock()
        self._closed = False
        self.proc: subprocess.Popen | None = None
        started: Future = Future()
        # The starter dies with the thread that started it (the parent-death signal):
        # a thread as long-lived as this process starts it, then reads its answers.
        command = [sys.executable, "-m", "basis.preload", "--fd", str(theirs.fileno()), *modules]
        self._thread = threading.Thread(target=self._run, args=(command, env, theirs, started),
                                        name="preload-starter", daemon=True)  # fmt: skip
        self._thread.start()
        started.result()

    def alive(self) -> bool:
        return not self._closed

    def close(self) -> None:
        """Ends the starter: it stops the services it forked and exits."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def spawn(
        self, argv: list[str], env: dict[str, str], outputs: tuple[int, int] | None = None
    ) -> ForkedProcess:
        read, write = os.pipe() if outputs is None else (None, None)
        answer: Future = Future()
        ident = None
        try:
            with self._send_lock:
                if self._closed:
                    raise RuntimeError("the preloaded starter has exited")
                ident = next(self._ids)
                self._asked[ident] = (answer, argv, read)
                request = {"id": ident, "argv": argv, "env": env, "cwd": os.getcwd()}
                sent = [write] if outputs is None else list(outputs)
                socket.send_fds(self._sock, [json.dumps(request).encode()], sent)
        except BaseException:
            with self._send_lock:  # the pipe is closed here unless another end took it
                mine = ident is None or self._asked.pop(ident, None) is not None
            if mine and read is not None:
                os.close(read)
            raise
        finally:
            if write is not None:
                os.close(write)
        # no timeout: the starter answers (after its imports, the first time) or exits,
        # and its exit fails every request it has not answered
        return answer.result()

    def _run(self, command, env, theirs, started: Future) -> None:
        try:
            proc = subprocess.Popen(command, pass_fds=[theirs.fileno()], env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    start_new_session=True,
                                    preexec_fn=die_with_parent)  # fmt: skip
        except BaseException as error:
            started.set_exception(error)
            return
        finally:
            theirs.close()
        self.proc = proc
        started.set_result(proc)
        try:
            self._read()
        finally:
            self._close()

    def _read(self) -> None:
        while True:
            try:
                message = self._sock.recv(MAX_MESSAGE)
            except OSError:  # reset: the starter is gone
                return
            if not message:
                return
            answer = json.loads(message)
            if "exit" in answer:
                forked = self._forked.pop(answer["exit"], None)
                if forked is not None:
                    forked._exited(answer["code"])
                continue
            future, argv, read = self._asked.pop(answer["id"])
            if "error" in answer:
                if read is not None:
                    os.close(read)
                future.set_exception(RuntimeError(answer["error"]))
                continue
            stdout = os.fdopen(read, "r") if read is not None else None
            forked = ForkedProcess(answer["pid"], argv, stdout)
            self._forked[forked.pid] = forked
            future.set_result(forked)

    def _close(self) -> None:
        """The starter is gone (or this end failed: then it is told to go). Its services
        go with it (their parent-death signal, a SIGTERM): each is reported ended, as
        killed by that signal, once its process is gone."""
        with self._send_lock:
            self._closed = True
            asked, self._asked = self._asked, {}
        for future, _, read in asked.values():
            if read is not None:
                os.close(read)
            future.set_exception(RuntimeError("the preloaded starter exited"))
        self._sock.close()
        self.proc.wait()
        left = list(self._forked.values())
        self._forked.clear()
        while left:
            for forked in [f for f in left if not _running(f.pid)]:
                forked._exited(-signal.SIGTERM)
                left.remove(forked)
            time.sleep(0.05)


def _running(pid: int) -> bool:
    """Whether a process (not yet reaped by whoever adopted it) still runs."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(") ")[2][:1] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False
