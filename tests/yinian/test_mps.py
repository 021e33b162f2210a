"""The mesh's own MPS daemon (yinian/mps.py). This machine has no GPU and no MPS:
the daemon here is a stand-in program that keeps the real one's protocol (`-f`
stays in the foreground and makes the control socket; `quit` on a second
invocation's stdin ends it), so what is checked is the launcher's side."""

from __future__ import annotations

import os
import stat
import sys

import pytest

from yinian import mps

STAND_IN = """#!{python}
import os, pathlib, sys, time
pipe = pathlib.Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
if sys.argv[1:] == ["-f"]:
    (pipe / "control").touch()
    while not (pipe / "quit").exists():
        time.sleep(0.02)
    sys.exit(0)
if sys.stdin.read().strip() == "quit":
    (pipe / "quit").touch()
"""


def test_when_a_mesh_wants_mps():
    assert mps.wanted("on", 0, []) and not mps.wanted("off", 4, [])
    assert not mps.wanted("auto", 0, [])  # no expert services: nothing shares a GPU
    assert not mps.wanted("auto", 4, ["--device", "cpu"])
    assert mps.wanted("auto", 4, []) == os.path.exists("/dev/nvidiactl")
    with pytest.raises(ValueError, match="mps must be one of"):
        mps.wanted("yes", 4, [])


def test_a_missing_daemon_is_an_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="nvidia-cuda-mps-control is not on PATH"):
        mps.MpsDaemon(tmp_path).start()


def test_the_daemon_runs_in_the_mesh_folder_and_quits(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / mps.CONTROL
    program.write_text(STAND_IN.format(python=sys.executable))
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    daemon = mps.MpsDaemon(tmp_path / "mesh")
    (tmp_path / "mesh").mkdir()
    env = daemon.start()
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "mesh" / "pipe")
    assert env["CUDA_MPS_LOG_DIRECTORY"] == str(tmp_path / "mesh" / "log")
    proc = daemon.proc
    assert proc.poll() is None  # serving its clients
    daemon.stop()
    assert proc.returncode == 0  # it quit when asked, not killed
    daemon.stop()  # twice is harmless
