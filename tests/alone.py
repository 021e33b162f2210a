"""Tests marked `alone` run with no other test beside them when the suite runs on
several processes (pytest-xdist): what they assert depends on having the
machine's cores (a step-time bound, a recovery deadline, a fixed port). Every
test holds a lock on one file while it runs, its fixtures' setup and teardown
included: shared by the others, exclusive for an `alone` one. A second file
lets a waiting `alone` test in first: while it waits, no other test starts."""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
from pathlib import Path

import pytest

MARK = "alone"


def configure(config) -> None:
    config.addinivalue_line(
        "markers", f"{MARK}: runs with no other test beside it (its bounds need the cores)"
    )


def _lock_paths(config) -> tuple[Path, Path] | None:
    worker = getattr(config, "workerinput", None)
    if worker is None:  # one process: every test runs alone anyway
        return None
    base = Path(tempfile.gettempdir()) / f"yinian-tests-{worker['testrunuid']}"
    return base.with_suffix(".gate"), base.with_suffix(".lock")


@contextlib.contextmanager
def _held(path: Path, mode: int):
    with path.open("a") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def turn(item):
    """Held while `item` runs: alone if it is marked so, else beside other unmarked tests."""
    paths = _lock_paths(item.config)
    if paths is None:
        yield
        return
    gate, lock = paths
    if item.get_closest_marker(MARK) is not None:
        with _held(gate, fcntl.LOCK_EX), _held(lock, fcntl.LOCK_EX):
            yield
        return
    shared = lock.open("a")
    try:
        with _held(gate, fcntl.LOCK_SH):  # an alone test waiting holds the gate: wait for it
            fcntl.flock(shared, fcntl.LOCK_SH)
        yield
    finally:
        fcntl.flock(shared, fcntl.LOCK_UN)
        shared.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with turn(item):
        yield
