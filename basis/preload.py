"""`python -m basis.preload --fd N MODULE...`: a preloaded starter. It imports the
given modules once, then forks each service it is asked for from itself, so a
service starts without importing them again (torch alone is about 2 s of CPU on a
small machine, and a test suite starts a few hundred services).

It speaks over the socket `--fd` names (a SOCK_SEQPACKET socket, a message a
datagram): a request is a JSON object {"id", "argv": [module, args...], "env",
"cwd"} with the service's output attached (one descriptor for both stdout and
stderr, or the two); it answers
{"id", "pid"} (or {"id", "error"}) and, when a service ends, {"exit": pid, "code":
its exit status as subprocess reports it}. basis/preload_client.py is the other end.

Its Python runs on one thread, and only that thread forks, so a fork copies no
lock another of its threads holds (libraries' own pools, such as OpenBLAS's, reset
themselves in a fork). Each service runs as `python -m module` would: in a session
of its own, dying with the starter (as the starter dies with its launcher), stdin
from /dev/null, its output where it was sent, the environment and working
directory it was given, its module run as `__main__`, its end an interpreter's
(non-daemon threads joined, exit handlers run, an uncaught KeyboardInterrupt
ending it by SIGINT). A request that fails (a fork the system refuses) is
answered with an error; the others go on. When its launcher goes (the socket
closes, or SIGTERM), the starter stops its services' groups and exits.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading

PR_SET_PDEATHSIG = 1
MAX_MESSAGE = 1 << 20


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except OSError:
        pass


class _Stop(Exception):
    pass


def _stop(signum, frame):
    raise _Stop


def _run_service(request: dict, outputs: list[int], keep_closed: list[int], starter: int) -> None:
    """In the forked child: becomes the service and never returns."""
    code, interrupted = 1, False
    try:
        os.setsid()
        die_with_parent()
        if os.getppid() != starter:  # the starter went before the signal was asked for
            os._exit(1)
        signal.set_wakeup_fd(-1)
        for fd in keep_closed:
            os.close(fd)
        # a fresh interpreter's dispositions
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(outputs[0], 1)
        os.dup2(outputs[-1], 2)
        for fd in outputs:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        module, *args = request["argv"]
        sys.argv = [module, *args]
        sys.path[0] = request["cwd"]  # as `python -m` puts its working directory first
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())
    finally:
        _exit_as_python(code, interrupted)


def _exit_as_python(code: int, interrupted: bool) -> None:
    """What an interpreter does as it ends: joins non-daemon threads, runs the exit
    handlers, flushes; then exits with `code`, or by SIGINT after an uncaught
    KeyboardInterrupt."""
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        sys.excepthook(*sys.exc_info())
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _stop_all(children: set[int]) -> None:
    for pid in children:
        try:
            os.killpg(pid, signal.SIGTERM)
        except OSError:
            pass


def serve(sock: socket.socket, modules: list[str]) -> None:
    for module in modules:
        importlib.import_module(module)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when we stop
    signal.signal(signal.SIGTERM, _stop)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    children: set[int] = set()
    status = 0
    try:
        while True:
            for key, _ in selector.select():
                if key.fileobj is not sock:
                    os.read(wake_read, 4096)
                    _reap(sock, children)
                    continue
                message, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
                if not message:
                    return  # the launcher is gone
                keep_closed = [sock.fileno(), wake_read, wake_write, selector.fileno()]
                sock.send(json.dumps(_start(message, fds, keep_closed, children)).encode())
    except (_Stop, BrokenPipeError, ConnectionResetError):
        pass
    except BaseException:
        sys.excepthook(*sys.exc_info())
        status = 1
    finally:
        _stop_all(children)
        os._exit(status)  # no interpreter teardown (torch's is slow): nothing is left to do


def _start(message: bytes, fds: list[int], keep_closed: list[int], children: set[int]) -> dict:
    """Forks the service a request asks for; the answer to send back."""
    ident = None
    try:
        request = json.loads(message)
        ident = request["id"]
        if not fds:
            raise ValueError("no output attached")
        starter = os.getpid()
        pid = os.fork()
        if pid == 0:
            _run_service(request, fds, keep_closed, starter)
        children.add(pid)
        return {"id": ident, "pid": pid}
    except Exception as error:  # this request fails; the starter serves the others
        return {"id": ident, "error": f"{type(error).__name__}: {error}"}
    finally:
        for fd in fds:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m basis.preload")
    parser.add_argument("--fd", type=int, required=True, help="the socket to the launcher")
    parser.add_argument("modules", nargs="*", help="modules to import before any fork")
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    serve(sock, args.modules)
    return 0


if __name__ == "__main__":
    sys.exit(main())
