"""The mesh the hostile-input, connection and fuzzing tests attack: the default
model on one colocated CPU worker, a short context (so fuzzed requests stay quick)
and short body, header and keep-alive timeouts and a low connection cap (so a
slow-drip client's 408, an idle connection's end and a refusal come within the
test)."""

from __future__ import annotations

import os

import pytest

from yinian.default_model import ensure_default_model
from yinian.mesh import Mesh, MeshSpec

MODEL = "pydoc-llama"
CONTEXT = 256
BODY_TIMEOUT = 2.0
HEADER_TIMEOUT = 2.0
KEEP_ALIVE = 2.0
MAX_CONNECTIONS = 1000


@pytest.fixture(scope="session", name="guarded_mesh")
def guarded_mesh_fixture():
    spec = MeshSpec(
        model=str(ensure_default_model()),
        workers=1,
        port=0,
        engine_argv=["--device", "cpu", "--max-num-seqs", "64", "--max-model-len", str(CONTEXT)],
        gateway_argv=[
            "--max-model-len",
            str(CONTEXT),
            "--body-timeout",
            str(BODY_TIMEOUT),
            "--header-timeout",
            str(HEADER_TIMEOUT),
            "--keep-alive-timeout",
            str(KEEP_ALIVE),
            "--max-connections",
            str(MAX_CONNECTIONS),
        ],  # fmt: skip
    )
    with Mesh(spec) as mesh:
        yield mesh


def gateway_rss(mesh) -> int:
    """The gateway's resident memory, in bytes."""
    status = open(f"/proc/{mesh.child('gateway').proc.pid}/status").read()
    kb = next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]
    return int(kb) * 1024


def gateway_fds(mesh) -> int:
    """How many file descriptors the gateway holds open."""
    return len(os.listdir(f"/proc/{mesh.child('gateway').proc.pid}/fd"))
