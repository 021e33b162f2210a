"""Shared fixtures: tiny random models written once per test session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# One torch thread in the tests and in every process they start (read when torch is
# imported): on a 2-core machine the test process, its meshes' services and gloo ranks
# run side by side, and two threads each only contend (tests/engine's kernel and
# parallel files took 63-75 s this way, 84-87 s with two).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

import basis.grpc_fork  # noqa: E402, F401  (this process starts many children)
from basis import preload_client  # noqa: E402

# The meshes the tests start here run their services as forks of a starter that
# imported them once (basis/preload_client.py): a worker's start costs ~0.1 s of CPU
# instead of ~2.7 s (mostly importing torch), and the suite starts a few hundred. A
# `yinian up` started as a child process launches its services as users see them.
preload_client.enable()

# Triton kernels run on the CPU through Triton's interpreter, which must be
# chosen before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from triton_interpreter import fix_interpreter  # noqa: E402

    fix_interpreter()

import alone  # noqa: E402
import pytest  # noqa: E402
from alone import pytest_runtest_protocol  # noqa: E402, F401 - `alone` tests run alone
from guarded_mesh import guarded_mesh_fixture  # noqa: E402, F401 - one mesh for the session
from heavy_first import order  # noqa: E402
from hf_oracle import ARCH_CONFIGS  # noqa: E402
from openai_mesh import default_mesh_fixture  # noqa: E402, F401 - one mesh for the session

from engine.make_model import TINY_PRESETS, preset_config, write_model  # noqa: E402

ALL_MODELS = (*TINY_PRESETS, *ARCH_CONFIGS)


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def model_dir(model_root):
    """model_dir(name) -> folder of that tiny model, written on first use."""

    def get(name: str) -> Path:
        folder = model_root / name
        if not (folder / "config.json").is_file():
            config = preset_config(name) if name in TINY_PRESETS else ARCH_CONFIGS[name]
            write_model(folder, config, seed=1)
        return folder

    return get


def pytest_configure(config):
    alone.configure(config)


def pytest_collection_modifyitems(config, items):
    order(items)  # the slowest files first (to balance the suite's two processes)
