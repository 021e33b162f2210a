"""Fuzzing, bounded for the suite (bench/reliability/fuzz.py runs the long one):
schemathesis against the gateway's own OpenAPI document, and hypothesis-generated
messages for the public gRPC service and the internal ones the gateway calls. No
5xx, no UNKNOWN or INTERNAL, and every service keeps serving."""

from __future__ import annotations

import grpc
import httpx
import pytest
from guarded_mesh import MODEL
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from proto_strategies import messages

from bench.reliability.fuzz import fuzz, still_serving
from proto.yinian.v1 import (
    inference_pb2,
    inference_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.tls import sync_channel
from yinian.mesh_probe import list_workers

Code = grpc.StatusCode
DELIBERATE = {Code.OK, Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.RESOURCE_EXHAUSTED}


def test_the_openapi_document_describes_the_request_bodies(guarded_mesh):
    document = httpx.get(f"{guarded_mesh.url}/openapi.json", timeout=30).json()
    schemas = document["components"]["schemas"]
    routes = [("/v1/completions", "CompletionRequest"),
              ("/v1/chat/completions", "ChatCompletionRequest"),
              ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")]  # fmt: skip
    for path, name in routes:
        post = document["paths"][path]["post"]
        body = post["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
        assert schemas[name]["additionalProperties"] is False  # unknown fields are refused
        assert post["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/ErrorBody"
        )
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["n"]["maximum"] == 128 and completion["model"]["enum"] == [MODEL]
    assert (
        "text/event-stream"
        in document["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    )


def test_schemathesis_finds_no_server_error(guarded_mesh):
    report = fuzz(guarded_mesh.url, 200, seed_value=7)
    assert report.requests >= 200
    assert report.server_errors == 0, report.as_dict()["statuses"]
    assert report.failures == [], report.failures[:3]
    assert sum(n for s, n in report.statuses.items() if s == "200") >= 10  # some really ran
    assert still_serving(guarded_mesh.url, MODEL)


def _call(method, request, streaming: bool) -> grpc.StatusCode:
    try:
        if streaming:
            for _ in method(request, timeout=30):
                pass
        else:
            method(request, timeout=30)
    except grpc.RpcError as exc:
        return exc.code()
    return Code.OK


def _fuzz_rpc(method, strategy, streaming: bool, allowed: set, examples: int) -> dict:
    seen: dict = {}

    @settings(max_examples=examples, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(strategy)
    def one(request) -> None:
        code = _call(method, request, streaming)
        seen[code] = seen.get(code, 0) + 1
        assert code in allowed, (code, request)

    one()
    return seen


def _with_model(message_class):
    return st.one_of(messages(message_class), messages(message_class, fixed={"model": MODEL}))


@pytest.mark.parametrize(
    ("method", "message_class", "streaming"),
    [("Complete", inference_pb2.CompletionRequest, False),
     ("CompleteStream", inference_pb2.CompletionRequest, True),
     ("Chat", inference_pb2.ChatRequest, False),
     ("ChatStream", inference_pb2.ChatRequest, True),
     ("ListModels", inference_pb2.ListModelsRequest, False)],
)  # fmt: skip
def test_generated_inference_messages_get_deliberate_answers(
    guarded_mesh, method, message_class, streaming
):
    channel = grpc.insecure_channel(f"127.0.0.1:{guarded_mesh.grpc_port}")
    stub = inference_pb2_grpc.InferenceStub(channel)
    strategy = (
        _with_model(message_class)
        if "model" in message_class.DESCRIPTOR.fields_by_name
        else messages(message_class)
    )
    seen = _fuzz_rpc(getattr(stub, method), strategy, streaming, DELIBERATE, 15)
    assert Code.OK in seen or method != "ListModels", seen
    assert still_serving(guarded_mesh.url, MODEL)


def test_generated_placements_get_deliberate_answers(guarded_mesh):
    channel = sync_channel(guarded_mesh.scheduler_address, None)  # the mesh token
    place = scheduler_pb2_grpc.SchedulerStub(channel).Place
    # UNAVAILABLE: every ready worker excluded (a deliberate answer)
    seen = _fuzz_rpc(place, messages(scheduler_pb2.PlaceRequest), False,
                     DELIBERATE | {Code.UNAVAILABLE}, 30)  # fmt: skip
    assert Code.OK in seen, seen
    assert still_serving(guarded_mesh.url, MODEL)


def test_generated_generate_requests_get_deliberate_answers(guarded_mesh):
    worker = list_workers(guarded_mesh)[0]
    channel = sync_channel(worker.info.address, None)  # the mesh token
    generate = worker_pb2_grpc.DecodeStub(channel).Generate
    seen = _fuzz_rpc(generate, messages(worker_pb2.GenerateRequest), True, DELIBERATE, 40)
    assert Code.INVALID_ARGUMENT in seen, seen
    assert still_serving(guarded_mesh.url, MODEL)
