"""The exporter's SDK side (observability/otel.py, run in the exporter process) against a
real OTLP receiver (helpers/otlp_receiver.py): spans, log records and GenAI metrics from
audit lines, a sandbox's trace continued or not sampled, time to first chunk, the
content a policy exports (and none without it), and a line that cannot be read."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.otlp_receiver import OtlpReceiver

from gateway.observability.otel import TTFC, TTFC_METRIC, OtelExport

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
USAGE = {"model": "gpt-4o-2024-08-06", "input_tokens": 11, "output_tokens": 7,
         "cached_input_tokens": None, "cost_usd": 0.001}


def _line(**over: Any) -> dict[str, Any]:
    line: dict[str, Any] = {
        "sandbox": "sb", "policy": "agent", "jti": "j", "client": "127.0.0.1:1",
        "listener": "proxy", "method": "POST", "scheme": "https", "host": "api.openai.com",
        "port": 443, "path": "/v1/chat/completions", "decision": "allow", "reason": "ok",
        "rule": "policies/agent.yaml:4", "status": 200, "error": None, "bytes_in": 10,
        "bytes_out": 20, "duration_ms": 12.5, "path_taken": "intercept", "engine": "h1",
        "credential": "openai", "policy_rev": "abc", "usage": None, "workload": None,
        "mcp": None, "models": None, "trace": None, "time": "2026-11-29T00:00:00.000Z"}
    line.update(over)
    return line


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as server:
        yield server


def _export(receiver: OtlpReceiver, **kw: Any) -> OtelExport:
    return OtelExport(endpoint=receiver.grpc_endpoint, logs=True, metrics_interval=3600, **kw)


def _emit(export: OtelExport, line: dict[str, Any], traced: bool = True,
          provider: str | None = None, content: dict[str, Any] | None = None) -> None:
    export.emit(line, time.time_ns(), traced, provider, content)


def test_spans_logs_and_metrics_from_lines(receiver: OtlpReceiver) -> None:
    export = _export(receiver, worker=2)
    _emit(export, _line(usage=USAGE, models=["gpt-4o"], trace=f"00-{TRACE}-00f067aa0ba902b7-01",
                        workload={"namespace": "ns", "pod": "p-1"}), provider="openai")
    _emit(export, _line(method="CONNECT", host="blocked.test", path=None, decision="deny",
                        error="host_not_allowed", credential=None, status=403))
    # a sandbox that did not sample its trace (the worker said: no span), the log goes
    _emit(export, _line(host="unsampled.test", trace=f"00-{TRACE}-00f067aa0ba902b8-00"),
          traced=False)
    export.close()
    spans = {s["name"]: s for s in receiver.spans()}
    assert set(spans) == {"chat gpt-4o", "CONNECT blocked.test"}
    chat = spans["chat gpt-4o"]
    assert (chat["trace_id"], chat["parent_span_id"]) == (TRACE, "00f067aa0ba902b7")
    assert chat["end"] - chat["start"] == 12_500_000
    assert chat["resource"]["sandbox_gateway.worker"] == 2
    assert {k: v for k, v in chat["attributes"].items() if k.startswith("gen_ai.")} == {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "gpt-4o", "gen_ai.response.model": "gpt-4o-2024-08-06",
        "gen_ai.usage.input_tokens": 11, "gen_ai.usage.output_tokens": 7}
    assert chat["attributes"]["sandbox_gateway.workload.pod"] == "p-1"
    refused = spans["CONNECT blocked.test"]
    assert refused["attributes"]["error.type"] == "host_not_allowed"
    assert refused["parent_span_id"] == "" and refused["status"] == 2
    logs = receiver.logs()
    bodies = [json.loads(r["body"]) for r in logs]
    assert [b["host"] for b in bodies] == ["api.openai.com", "blocked.test", "unsampled.test"]
    assert logs[2]["trace_id"] == TRACE  # (in the sandbox's trace all the same)
    assert bodies[0]["usage"] == USAGE  # (the line as the JSON sink writes it)
    found = receiver.metrics()
    tokens = found["gen_ai.client.token.usage"]
    assert sorted(int(p["sum"]) for p in tokens) == [7, 11]
    assert found["gen_ai.client.operation.duration"][0]["count"] == "1"
    assert TTFC_METRIC not in found  # (no streamed answer: no time to first chunk)


SENT_SPAN = "a1b2c3d4e5f60718"
NEW_TRACE = "0af7651916cd43dd8448eb211c80319c"


def test_a_propagated_span_has_the_ids_the_gateway_sent_upstream(
        receiver: OtlpReceiver) -> None:
    """`telemetry.propagate`: the line's `trace_sent` (the traceparent the upstream got)
    gives the gateway's span its ids, in the sandbox's trace (its span the parent) or a
    new one; on the cached-shape path, the general one (an inference call) and a datagram
    of lines (`emit_many`); an unreadable `trace_sent` is a new span as before."""
    export = _export(receiver)
    sandbox = f"00-{TRACE}-00f067aa0ba902b7-01"
    lines = [
        _line(host="plain.test", credential=None, trace_sent=f"00-{NEW_TRACE}-{SENT_SPAN}-01"),
        _line(host="child.test", credential=None, trace=sandbox,
              trace_sent=f"00-{TRACE}-{SENT_SPAN}-01"),
        _line(usage=USAGE, models=["gpt-4o"], trace_sent=f"00-{NEW_TRACE}-{SENT_SPAN}-01"),
        _line(host="odd.test", credential=None, trace_sent="not-a-traceparent"),
    ]
    for line in lines[:2]:
        _emit(export, line)
    raws = [json.dumps(line).encode() for line in lines[2:]]
    export.emit_many(raws, [time.time_ns()] * 2, [b"T", b"T"], [b"", b""],
                     lambda i: _emit(export, lines[2 + i]))
    export.close()
    spans = {s["name"]: s for s in receiver.spans()}
    assert (spans["POST plain.test"]["trace_id"], spans["POST plain.test"]["span_id"],
            spans["POST plain.test"]["parent_span_id"]) == (NEW_TRACE, SENT_SPAN, "")
    assert (spans["POST child.test"]["trace_id"], spans["POST child.test"]["span_id"],
            spans["POST child.test"]["parent_span_id"]) == (
        TRACE, SENT_SPAN, "00f067aa0ba902b7")
    assert (spans["chat gpt-4o"]["trace_id"], spans["chat gpt-4o"]["span_id"]) == (
        NEW_TRACE, SENT_SPAN)
    assert spans["POST odd.test"]["span_id"] != SENT_SPAN
    logs = {json.loads(r["body"])["host"]: r for r in receiver.logs()}
    assert (logs["child.test"]["trace_id"], logs["child.test"]["span_id"]) == (
        TRACE, SENT_SPAN)


def test_time_to_first_chunk_on_a_streamed_call(receiver: OtlpReceiver) -> None:
    """`usage.first_chunk_ms` (a streamed answer's) becomes the conventions' span
    attribute, in seconds, and a point of their time-to-first-chunk histogram."""
    export = _export(receiver)
    _emit(export, _line(usage={**USAGE, "first_chunk_ms": 250.5}, models=["gpt-4o"]))
    _emit(export, _line(usage=USAGE, models=["gpt-4o-mini"]))  # (not streamed)
    export.close()
    spans = {s["name"]: s for s in receiver.spans()}
    assert spans["chat gpt-4o"]["attributes"][TTFC] == pytest.approx(0.2505)
    assert TTFC not in spans["chat gpt-4o-mini"]["attributes"]
    points = receiver.metrics()[TTFC_METRIC]
    assert [(p["count"], p["sum"]) for p in points] == [("1", pytest.approx(0.2505))]


def test_content_goes_only_where_the_worker_sent_it(receiver: OtlpReceiver) -> None:
    """Content (already redacted by the worker) becomes the conventions' attributes on
    the exchange's span, and a tool call's arguments and result on its tool span; the log
    record (the audit line) never carries it."""
    export = _export(receiver)
    calls = [{"method": "tools/call", "name": "search", "decision": "allow"}]
    _emit(export, _line(usage=USAGE, models=["gpt-4o"]),
          content={"input": '{"messages":"hi [REDACTED]"}', "output": "data: answer"})
    _emit(export, _line(host="mcp.test", path="/mcp", credential=None, mcp=calls),
          content={"input": '{"jsonrpc":"2.0","id":1,"method":"tools/call","params":'
                            '{"name":"search","arguments":{"q":"cats"}}}',
                   "output": '{"jsonrpc":"2.0","id":1,"result":{"content":[]}}'})
    _emit(export, _line(host="plain.test", models=["m"], usage=USAGE))
    export.close()
    spans = {s["name"]: s for s in receiver.spans()}
    chat = spans["chat gpt-4o"]["attributes"]
    assert chat["gen_ai.input.messages"] == '{"messages":"hi [REDACTED]"}'
    assert chat["gen_ai.output.messages"] == "data: answer"
    tool = spans["tools/call search"]["attributes"]
    assert json.loads(tool["gen_ai.tool.call.arguments"]) == {"q": "cats"}
    assert json.loads(tool["gen_ai.tool.call.result"]) == {"content": []}
    assert "gen_ai.input.messages" not in spans["chat m"]["attributes"]
    for record in receiver.logs():
        assert "messages" not in record["body"] and "cats" not in record["body"]


def test_a_bad_line_is_logged_and_the_export_goes_on(receiver: OtlpReceiver) -> None:
    export = _export(receiver)
    with pytest.raises(ValueError):
        _emit(export, _line(duration_ms="not a number"))
    _emit(export, _line(host="next.test"))
    export.close()
    assert [s["name"] for s in receiver.spans()] == ["POST next.test"]
