"""`pid_alive`, which the same-host data paths use to notice a peer's death."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from basis.host_regions import pid_alive


def test_an_exited_child_not_reaped_yet_is_not_alive():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    assert pid_alive(os.getpid())
    deadline = time.monotonic() + 10
    while pid_alive(proc.pid):  # a zombie until reaped: its peers must not wait on it
        assert time.monotonic() < deadline, "an exited process still counts as alive"
        time.sleep(0.01)
    proc.wait()
    assert not pid_alive(proc.pid)
