"""The mesh the hostile-input, connection and fuzzing tests attack: the default
model on one colocated CPU worker, a short context (so fuzzed requests stay quick)
and a short body timeout (so a slow-drip client's 408 comes within the test)."""

from __future__ import annotations

import pytest

from yinian.default_model import ensure_default_model
from yinian.mesh import Mesh, MeshSpec

MODEL = "pydoc-llama"
CONTEXT = 256
BODY_TIMEOUT = 2.0


@pytest.fixture(scope="session", name="guarded_mesh")
def guarded_mesh_fixture():
    spec = MeshSpec(
        model=str(ensure_default_model()),
        workers=1,
        port=0,
        engine_argv=["--device", "cpu", "--max-num-seqs", "64", "--max-model-len", str(CONTEXT)],
        gateway_argv=["--max-model-len", str(CONTEXT), "--body-timeout", str(BODY_TIMEOUT)],
    )
    with Mesh(spec) as mesh:
        yield mesh


def gateway_rss(mesh) -> int:
    """The gateway's resident memory, in bytes."""
    status = open(f"/proc/{mesh.child('gateway').proc.pid}/status").read()
    kb = next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]
    return int(kb) * 1024
