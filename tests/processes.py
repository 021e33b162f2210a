"""Processes as tests look at them."""

from __future__ import annotations

import subprocess


def alive(pid: int) -> bool:
    return subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode == 0
