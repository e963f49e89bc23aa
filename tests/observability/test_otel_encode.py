"""OTLP spans and log records encoded by hand (observability/otel_encode.py), read back
by the protocol's own classes (opentelemetry-proto): attribute value types, the
sandbox's traceparent read, a span's ids, times, kind, status and flags, a log record's
severity, body and ids, and whole export requests — the same messages the protocol's
classes build from the same fields."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord, SeverityNumber
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from gateway.observability import otel_encode as otlp

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.mark.parametrize(("value", "kind", "read"), [
    ("a", "string_value", "a"), ("é ✓", "string_value", "é ✓"), (3, "int_value", 3),
    (-2, "int_value", -2), (1 << 40, "int_value", 1 << 40), (0, "int_value", 0),
    (0.5, "double_value", 0.5), (True, "bool_value", True), (False, "bool_value", False),
    (["x"], "string_value", "['x']")])
def test_attribute_values(value: Any, kind: str, read: Any) -> None:
    for _ in range(2):  # (the second time from what was remembered)
        resource = Resource.FromString(otlp.resource({"k": value, "gone": None}))
        (kv,) = resource.attributes
        assert kv.key == "k" and kv.value.WhichOneof("value") == kind
        assert getattr(kv.value, kind) == read


def test_equal_values_of_other_types_are_not_confused() -> None:
    """1 == True == 1.0 in Python: each keeps its own type on the wire."""
    kinds = [Resource.FromString(otlp.resource({"k": v})).attributes[0].value.WhichOneof(
        "value") for v in (1, True, 1.0, 1)]
    assert kinds == ["int_value", "bool_value", "double_value", "int_value"]


@pytest.mark.parametrize(("header", "parent"), [
    (f"00-{TRACE}-00f067aa0ba902b7-01",
     (bytes.fromhex(TRACE), bytes.fromhex("00f067aa0ba902b7"), 1)),
    (f"00-{TRACE}-00f067aa0ba902b7-00",
     (bytes.fromhex(TRACE), bytes.fromhex("00f067aa0ba902b7"), 0)),
    (None, None), ("", None), ("00-zz", None)])
def test_parent_of(header: str | None, parent: otlp.Parent | None) -> None:
    assert otlp.parent_of(header) == parent


def test_ids_are_random_and_never_zero() -> None:
    ids = {otlp.span_id() for _ in range(100)}
    assert len(ids) == 100 and all(len(i) == 8 and any(i) for i in ids)
    assert len(otlp.trace_id()) == 16 and otlp.trace_id() != otlp.trace_id()


def _kvs(attrs: dict[str, Any]) -> list[KeyValue]:
    def any_value(v: Any) -> AnyValue:
        if isinstance(v, bool):
            return AnyValue(bool_value=v)
        if isinstance(v, int):
            return AnyValue(int_value=v)
        if isinstance(v, float):
            return AnyValue(double_value=v)
        return AnyValue(string_value=v)
    return [KeyValue(key=k, value=any_value(v)) for k, v in attrs.items()]


@pytest.mark.parametrize("error", [None, "mcp_denied"])
@pytest.mark.parametrize("parent", [b"", bytes.fromhex("00f067aa0ba902b7")])
def test_a_span_is_the_message_the_protocol_builds(error: str | None, parent: bytes) -> None:
    trace_id, own = bytes.fromhex(TRACE), otlp.span_id()
    attrs = {"sandbox_gateway.decision": "deny", "http.response.status_code": 403,
             "sandbox_gateway.cost_usd": 0.25, "flag": True}
    got = Span.FromString(otlp.span("POST a.test", otlp.SERVER, trace_id, own, parent,
                                    1_700_000_000_000_000_000, 1_700_000_000_100_000_000,
                                    attrs, error))
    want = Span(trace_id=trace_id, span_id=own, parent_span_id=parent, name="POST a.test",
                kind=Span.SPAN_KIND_SERVER, start_time_unix_nano=1_700_000_000_000_000_000,
                end_time_unix_nano=1_700_000_000_100_000_000, attributes=_kvs(attrs),
                flags=0x100, status=Status(code=Status.STATUS_CODE_ERROR, message=error)
                if error is not None else None)
    assert got == want
    assert otlp.CLIENT == Span.SPAN_KIND_CLIENT


@pytest.mark.parametrize("warn", [False, True])
def test_a_log_record_is_the_message_the_protocol_builds(warn: bool) -> None:
    trace_id, own = bytes.fromhex(TRACE), otlp.span_id()
    body = b'{"host":"a.test","note":"\xc3\xa9"}'
    got = LogRecord.FromString(otlp.log_record(body, 5, {"error.type": "policy_denied"},
                                               warn, trace_id, own))
    want = LogRecord(
        time_unix_nano=5, observed_time_unix_nano=5,
        severity_number=SeverityNumber.SEVERITY_NUMBER_WARN if warn
        else SeverityNumber.SEVERITY_NUMBER_INFO, severity_text="WARN" if warn else "INFO",
        body=AnyValue(string_value=body.decode()),
        attributes=_kvs({"error.type": "policy_denied"}), trace_id=trace_id, span_id=own,
        event_name="sandbox_gateway.audit")
    assert got == want
    untraced = LogRecord.FromString(otlp.log_record("{}", 5, {}, False))
    assert (untraced.trace_id, untraced.span_id, untraced.body.string_value) == (
        b"", b"", "{}")


def test_export_requests_the_protocol_reads_back() -> None:
    trace_id, own = bytes.fromhex(TRACE), otlp.span_id()
    ok = otlp.span("GET a.test", otlp.SERVER, trace_id, own, b"", 1, 2, {"x": 1})
    failed = otlp.span("tools/call t", otlp.CLIENT, trace_id, otlp.span_id(), own, 1, 2, {},
                       "mcp_denied")
    res = otlp.resource({"service.name": "s", "sandbox_gateway.worker": 3})
    request = ExportTraceServiceRequest.FromString(otlp.traces_request(res, "scope",
                                                                       [ok, failed]))
    (rs,) = request.resource_spans
    assert rs.resource == Resource(attributes=_kvs({"service.name": "s",
                                                    "sandbox_gateway.worker": 3}))
    (ss,) = rs.scope_spans
    assert ss.scope.name == "scope" and [s.name for s in ss.spans] == [
        "GET a.test", "tools/call t"]
    assert ss.spans[0].status.code == Status.STATUS_CODE_UNSET
    assert ss.spans[1].parent_span_id == own and ss.spans[1].status.message == "mcp_denied"
    logs = ExportLogsServiceRequest.FromString(otlp.logs_request(
        res, "scope", [otlp.log_record("{}", 5, {}, False)] * 3))
    (rl,) = logs.resource_logs
    assert rl.resource.attributes[0].value.string_value == "s"
    assert rl.scope_logs[0].scope.name == "scope" and len(rl.scope_logs[0].log_records) == 3
