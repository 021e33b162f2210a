"""The mesh the OpenAI-surface tests talk to: the default (trained) model on one
colocated CPU worker, real processes on loopback, started once per session."""

from __future__ import annotations

import functools

import httpx
import openai
import pytest

from yinian.default_model import ensure_default_model
from yinian.mesh import Mesh, MeshSpec
from yinian.mesh_probe import default_tls

MODEL = "pydoc-llama"


@pytest.fixture(scope="session", name="default_mesh")
def default_mesh_fixture():
    spec = MeshSpec(
        model=str(ensure_default_model()),
        workers=1,
        port=0,
        engine_argv=["--device", "cpu", "--max-num-seqs", "128"],
    )
    with Mesh(spec) as mesh:
        yield mesh


def client(mesh) -> openai.OpenAI:
    return _client(mesh.url)


@functools.cache
def _client(url: str) -> openai.OpenAI:
    # no retries (a failure shows), so the pool must let an idle connection go before the
    # gateway does (--keep-alive-timeout 5 s): at the package's own 5 s, a request sent on
    # a connection the gateway was closing at that moment met "Server disconnected without
    # sending a response" (a CI run of stop 82), where a retry would have hidden it
    limits = openai._base_client.DEFAULT_CONNECTION_LIMITS
    pool = type(limits)(max_connections=limits.max_connections,
                        max_keepalive_connections=limits.max_keepalive_connections,
                        keepalive_expiry=2.0)  # fmt: skip
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                         http_client=openai.DefaultHttpxClient(limits=pool))  # fmt: skip


def post(mesh, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{mesh.url}{path}", json=body, timeout=120, verify=default_tls())
