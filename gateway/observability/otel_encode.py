"""OTLP spans and log records built directly as protobuf messages (opentelemetry-proto's),
in the exporter process: no SDK span or log objects, whose building and encoding cost
2-4x as much per audit line (docs/observability.md, "Cost")."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import (
    LogRecord,
    ResourceLogs,
    ScopeLogs,
    SeverityNumber,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

__all__ = [
    "CLIENT",
    "SERVER",
    "Parent",
    "attributes",
    "log_record",
    "logs_request",
    "parent_of",
    "resource",
    "span",
    "span_id",
    "traces_request",
]

SERVER = Span.SPAN_KIND_SERVER
CLIENT = Span.SPAN_KIND_CLIENT
# (trace id, parent span id, flags) of a sandbox's traceparent
Parent = tuple[bytes, bytes, int]


def _value(value: Any) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    return AnyValue(string_value=value if isinstance(value, str) else str(value))


def attributes(attrs: Mapping[str, Any]) -> list[KeyValue]:
    """OTLP attributes (a None value is left out)."""
    return [KeyValue(key=key, value=_value(value)) for key, value in attrs.items()
            if value is not None]


def resource(attrs: Mapping[str, Any]) -> Resource:
    return Resource(attributes=attributes(attrs))


def parent_of(trace_header: str | None) -> Parent | None:
    """The sandbox's span (`trace`: a traceparent the core checked), or None."""
    if not trace_header:
        return None
    parts = trace_header.split("-")
    try:
        return (bytes.fromhex(parts[1]), bytes.fromhex(parts[2]), int(parts[3][:2], 16) & 1)
    except (IndexError, ValueError):
        return None


def span_id() -> bytes:
    return os.urandom(8)


def span(name: str, kind: Span.SpanKind.ValueType, trace_id: bytes, own_id: bytes, parent_id: bytes,
         start: int, end: int, attrs: Mapping[str, Any], error: str | None = None) -> Span:
    """One span; `error`: its status is ERROR with that message."""
    return Span(trace_id=trace_id, span_id=own_id, parent_span_id=parent_id, name=name,
                kind=kind, start_time_unix_nano=start, end_time_unix_nano=end,
                attributes=attributes(attrs), flags=0x100,  # (sampled: W3C flags in OTLP)
                status=Status(code=Status.STATUS_CODE_ERROR, message=error)
                if error is not None else None)


def log_record(body: str, end: int, attrs: Mapping[str, Any], warn: bool,
               trace_id: bytes = b"", own_id: bytes = b"",
               event: str = "sandbox_gateway.audit") -> LogRecord:
    return LogRecord(time_unix_nano=end, observed_time_unix_nano=end,
                     severity_number=SeverityNumber.SEVERITY_NUMBER_WARN if warn
                     else SeverityNumber.SEVERITY_NUMBER_INFO,
                     severity_text="WARN" if warn else "INFO",
                     body=AnyValue(string_value=body), attributes=attributes(attrs),
                     trace_id=trace_id, span_id=own_id, event_name=event)


def traces_request(res: Resource, scope: str, spans: Iterable[Span]
                   ) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource=res, scope_spans=[ScopeSpans(scope=InstrumentationScope(name=scope),
                                              spans=spans)])])


def logs_request(res: Resource, scope: str, records: Iterable[LogRecord]
                 ) -> ExportLogsServiceRequest:
    return ExportLogsServiceRequest(resource_logs=[ResourceLogs(
        resource=res, scope_logs=[ScopeLogs(scope=InstrumentationScope(name=scope),
                                            log_records=records)])])
