"""An in-process OTLP/gRPC trace receiver for tests: every span every
service exports, flattened to plain records."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class SpanRecord:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict
    start_ns: int
    end_ns: int


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans: list[SpanRecord] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):
        with self._lock:
            for rs in request.resource_spans:
                attrs = {a.key: _value(a.value) for a in rs.resource.attributes}
                service = attrs.get("service.name", "")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(
                            SpanRecord(
                                service,
                                s.name,
                                s.trace_id.hex(),
                                s.span_id.hex(),
                                s.parent_span_id.hex(),
                                {a.key: _value(a.value) for a in s.attributes},
                                s.start_time_unix_nano,
                                s.end_time_unix_nano,
                            )
                        )
        return trace_service_pb2.ExportTraceServiceResponse()

    def start(self) -> OtlpReceiver:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(0)

    def snapshot(self) -> list[SpanRecord]:
        with self._lock:
            return list(self.spans)
