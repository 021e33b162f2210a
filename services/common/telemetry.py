"""OpenTelemetry tracing for every service, configured only by the standard
OTEL_* environment variables: with no OTLP endpoint set (or with
OTEL_SDK_DISABLED=true) nothing is exported. Trace context crosses gRPC as
metadata and NATS as headers (W3C traceparent), so one request is one trace
across every process it touches."""

from __future__ import annotations

import atexit
import logging
import os

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

logger = logging.getLogger(__name__)
_configured = False


def tracing_enabled() -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower() == "none":
        return False
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def setup_tracing(service_name: str) -> bool:
    """Installs an OTLP-exporting tracer provider when the environment asks for one."""
    global _configured
    if _configured or not tracing_enabled():
        return _configured
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    )
    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    name = os.environ.get("OTEL_SERVICE_NAME", service_name)
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    atexit.register(provider.shutdown)
    _configured = True
    logger.info("tracing to OTLP as service %s (%s)", name, protocol)
    return True


def shutdown_tracing() -> None:
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def grpc_metadata(ctx=None) -> list[tuple[str, str]]:
    """The current trace context as gRPC metadata."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return list(carrier.items())


def context_from_grpc(context) -> otel_context.Context:
    """The caller's trace context from a servicer's `context`."""
    metadata = context.invocation_metadata() or ()
    return propagate.extract({k: v for k, v in metadata if isinstance(v, str)})


def nats_headers(ctx=None) -> dict[str, str]:
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier


def context_from_headers(headers: dict | None) -> otel_context.Context:
    return propagate.extract(headers or {})
