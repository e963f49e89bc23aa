"""OTLP messages built directly (observability/otel_encode.py): attribute value types,
the sandbox's traceparent read, a span's status and a log record's severity, and a
request the protocol's own classes read back."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from gateway.observability import otel_encode as otlp

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.mark.parametrize(("value", "kind", "read"), [
    ("a", "string_value", "a"), (3, "int_value", 3), (0.5, "double_value", 0.5),
    (True, "bool_value", True), (["x"], "string_value", "['x']")])
def test_attribute_values(value: Any, kind: str, read: Any) -> None:
    (kv,) = otlp.attributes({"k": value, "gone": None})
    assert kv.key == "k" and kv.value.WhichOneof("value") == kind
    assert getattr(kv.value, kind) == read


@pytest.mark.parametrize(("header", "parent"), [
    (f"00-{TRACE}-00f067aa0ba902b7-01",
     (bytes.fromhex(TRACE), bytes.fromhex("00f067aa0ba902b7"), 1)),
    (f"00-{TRACE}-00f067aa0ba902b7-00",
     (bytes.fromhex(TRACE), bytes.fromhex("00f067aa0ba902b7"), 0)),
    (None, None), ("", None), ("00-zz", None)])
def test_parent_of(header: str | None, parent: otlp.Parent | None) -> None:
    assert otlp.parent_of(header) == parent


def test_a_request_the_protocol_reads_back() -> None:
    trace_id, own = bytes.fromhex(TRACE), otlp.span_id()
    ok = otlp.span("GET a.test", otlp.SERVER, trace_id, own, b"", 1, 2, {"x": 1})
    failed = otlp.span("tools/call t", otlp.CLIENT, trace_id, otlp.span_id(), own, 1, 2, {},
                       "mcp_denied")
    request = ExportTraceServiceRequest.FromString(otlp.traces_request(
        otlp.resource({"service.name": "s"}), "scope", [ok, failed]).SerializeToString())
    spans = request.resource_spans[0].scope_spans[0].spans
    assert [s.name for s in spans] == ["GET a.test", "tools/call t"]
    assert spans[0].status.code == Status.STATUS_CODE_UNSET
    assert (spans[1].status.code, spans[1].status.message) == (Status.STATUS_CODE_ERROR,
                                                               "mcp_denied")
    assert spans[1].parent_span_id == own and len(own) == 8
    assert request.resource_spans[0].scope_spans[0].scope.name == "scope"


def test_log_record_severity() -> None:
    assert otlp.log_record("{}", 5, {}, warn=True).severity_text == "WARN"
    info = otlp.log_record("{}", 5, {"a": "b"}, warn=False)
    assert (info.severity_text, info.body.string_value, info.event_name) == (
        "INFO", "{}", "sandbox_gateway.audit")
