"""Which tests the suite's two processes (pytest-xdist, `--dist loadgroup`) must run
on one: those of a module that share a module-, class- or package-scoped fixture
(a mesh started once for the module) are one group, so the fixture starts once.
A test that uses none goes wherever a process is free, so a long file of
independent tests (the GPU scripts' dry runs, the chaos drills) is split between
the two instead of keeping one busy while the other waits at the end."""

from __future__ import annotations

import pytest

SHARED_SCOPES = {"module", "class", "package"}


def uses_a_shared_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs[-1].scope in SHARED_SCOPES for defs in info.name2fixturedefs.values() if defs)


def group(items) -> None:
    """Marks each test that shares a fixture with its module's others with the
    module's group."""
    for item in items:
        if uses_a_shared_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
