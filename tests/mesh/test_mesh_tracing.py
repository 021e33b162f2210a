"""One request is one trace across every service it touched, exported over
OTLP by each process and received here."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from bench.otlp_receiver import OtlpReceiver
from yinian.mesh import Mesh, MeshSpec


@pytest.fixture(scope="module", params=["gateway", "scheduler"])
def traced_mesh(model_dir, request):
    """A mesh exporting its spans, with either placer (the gateway by default)."""
    receiver = OtlpReceiver().start()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
    }
    spec = MeshSpec(
        model=str(model_dir("tiny-llama")),
        workers=2,
        port=0,
        env=env,
        engine_argv=["--device", "cpu"],
        gateway_argv=["--placement", request.param],
    )
    with Mesh(spec) as mesh:
        yield mesh, receiver, request.param
    receiver.stop()


def wait_for(receiver, predicate, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = receiver.snapshot()
        if predicate(spans):
            return spans
        time.sleep(0.1)
    return receiver.snapshot()


@pytest.mark.parametrize("stream", [False, True])
def test_one_trace_per_request_across_processes(traced_mesh, stream):
    mesh, receiver, placer = traced_mesh
    ids = []
    for i in range(3):
        resp = httpx.post(
            f"{mesh.url}/v1/completions",
            timeout=60,
            json={
                "model": "tiny-llama",
                "prompt": f"trace me {i}",
                "max_tokens": 5,
                "stream": stream,
            },
        )
        assert resp.status_code == 200
        if stream:
            first = next(line for line in resp.text.splitlines() if line.startswith("data: {"))
            ids.append(json.loads(first.removeprefix("data: "))["id"])
        else:
            ids.append(resp.json()["id"])

    expected = {"gateway.request", "placement", "worker.stream", "worker.generate", "queue",
                "prefill", "handover", "decode", "detokenize"}  # fmt: skip
    services = {"yinian-gateway", "yinian-colocated"}
    if placer == "scheduler":  # a call to it
        expected.add("scheduler.place")
        services.add("yinian-scheduler")

    def complete(spans):
        # Each process exports its spans on its own schedule: wait for every one of them.
        traces = [_trace_of(spans, rid) for rid in ids]
        return all(
            expected <= {s.name for s in spans if s.trace_id == trace} for trace in traces
        ) and all(
            sum(1 for s in spans if s.name == "decode" and s.trace_id == trace) == 1
            for trace in traces
        )

    spans = wait_for(receiver, complete)
    for rid in ids:
        trace_id = _trace_of(spans, rid)
        assert trace_id, f"no gateway span for {rid}"
        mine = [s for s in spans if s.trace_id == trace_id]
        by_id = {s.span_id: s for s in mine}
        names = {s.name for s in mine}
        assert expected <= names
        assert {s.service for s in mine} == services
        roots = [s for s in mine if not s.parent_id]
        assert len(roots) == 1 and roots[0].service == "yinian-gateway"
        request = next(s for s in mine if s.name == "gateway.request")
        chain = request
        while chain.parent_id:  # gateway.request hangs (indirectly) from the HTTP root
            chain = by_id[chain.parent_id]
        assert chain is roots[0]

        def parent(name, mine=mine, by_id=by_id):
            span = next(s for s in mine if s.name == name)
            return by_id[span.parent_id].name

        assert parent("placement") == "gateway.request"
        placement = next(s for s in mine if s.name == "placement")
        if placer == "scheduler":
            assert parent("scheduler.place") == "placement"
        else:
            assert placement.attributes["yinian.placed_by"] == "gateway"
        assert parent("worker.stream") == "gateway.request"
        assert parent("worker.generate") == "worker.stream"
        stages = ("queue", "prefill", "handover", "decode")
        assert {parent(n) for n in stages} == {"worker.generate"}
        assert parent("detokenize") == "worker.stream"
        attrs = request.attributes
        assert attrs["yinian.request_id"] == rid and attrs["gen_ai.usage.input_tokens"] > 0
        gen = next(s for s in mine if s.name == "worker.generate").attributes
        assert gen["gen_ai.usage.output_tokens"] == 5 and "yinian.cached_tokens" in gen


def _trace_of(spans, request_id: str) -> str:
    for s in spans:
        if s.name == "gateway.request" and s.attributes.get("yinian.request_id") == request_id:
            return s.trace_id
    return ""
