"""An in-process OTLP/gRPC trace receiver (tests, and benchmarks that break a
request's time down by stage): every span every service exports, as plain records."""

from __future__ import annotations

import statistics
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


def stages(spans: list[SpanRecord]) -> dict[str, dict[str, float]]:
    """Per "service/span name", the median start after its trace's first span and the
    median duration, in ms, over the traces in `spans`: where a request's time goes."""
    traces: dict[str, list[SpanRecord]] = {}
    for s in spans:
        traces.setdefault(s.trace_id, []).append(s)
    rows: dict[str, list[tuple[float, float]]] = {}
    for members in traces.values():
        origin = min(s.start_ns for s in members)
        for s in members:
            key = f"{s.service}/{s.name}"
            rows.setdefault(key, []).append(
                ((s.start_ns - origin) / 1e6, (s.end_ns - s.start_ns) / 1e6)
            )
    out = {}
    for key, values in sorted(rows.items(), key=lambda kv: statistics.median(v[0] for v in kv[1])):
        out[key] = {
            "start_ms": round(statistics.median(v[0] for v in values), 3),
            "ms": round(statistics.median(v[1] for v in values), 3),
            "n": len(values),
        }
    return out
