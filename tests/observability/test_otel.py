"""The OpenTelemetry sink (observability/otel.py) against a real OTLP receiver
(helpers/otlp_receiver.py): names and GenAI attributes from audit lines, a sandbox's
unsampled trace, what is dropped when the queue is full, and that the SDK is imported
only when `telemetry.endpoint` is set."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.otlp_receiver import OtlpReceiver

from gateway.observability import metrics
from gateway.observability.otel import OtelSink, operation, provider_name, span_name

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


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


USAGE = {"model": "gpt-4o-2024-08-06", "input_tokens": 11, "output_tokens": 7,
         "cached_input_tokens": None, "cost_usd": 0.001}
NAMES = [
    (_line(usage=USAGE, models=["gpt-4o"]), "chat gpt-4o"),
    (_line(usage=USAGE), "chat gpt-4o-2024-08-06"),  # no request model: the response's
    (_line(usage=USAGE, path="/v1/embeddings", models=["te-3"]), "embeddings te-3"),
    (_line(usage=USAGE, path="/v1/completions", models=["d"]), "text_completion d"),
    (_line(usage=USAGE, path="/v1beta/models/g:generateContent", models=["g"]),
     "generate_content g"),
    (_line(), "POST api.openai.com"),
    (_line(method="CONNECT", host="x.test", path=None), "CONNECT x.test"),
    (_line(method=None, host=None), "proxy"),
]


@pytest.mark.parametrize(("line", "name"), NAMES)
def test_span_names(line: dict[str, Any], name: str) -> None:
    assert span_name(line) == name


@pytest.mark.parametrize(("preset", "name"), [
    ("openai", "openai"), ("anthropic", "anthropic"), ("gemini", "gcp.gemini"),
    ("azure-openai", "azure.ai.openai"), ("bedrock", "aws.bedrock"),
    ("mistral", "mistral_ai"), ("someone", "someone"), (None, None)])
def test_provider_names(preset: str | None, name: str | None) -> None:
    assert provider_name(preset) == name


def test_no_operation_without_usage() -> None:
    assert operation("/v1/chat/completions", None) is None


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as server:
        yield server


def _sink(receiver: OtlpReceiver, **kw: Any) -> OtelSink:
    return OtelSink(endpoint=receiver.grpc_endpoint, logs=True, metrics_interval=3600,
                    preset_of=lambda c: "openai" if c == "openai" else None, **kw)


def test_spans_logs_and_metrics_from_lines(receiver: OtlpReceiver) -> None:
    sink = _sink(receiver, worker=2)
    sink.write(_line(usage=USAGE, models=["gpt-4o"], trace=f"00-{TRACE}-00f067aa0ba902b7-01",
                     workload={"namespace": "ns", "pod": "p-1"}))
    sink.write(_line(method="CONNECT", host="blocked.test", path=None, decision="deny",
                     error="host_not_allowed", credential=None, status=403))
    # a sandbox that did not sample its trace: no span, the log record still goes
    sink.write(_line(host="unsampled.test", trace=f"00-{TRACE}-00f067aa0ba902b8-00"))
    sink.close()  # (exports what is queued)
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


def test_sampling_keeps_refusals_inference_mcp_and_sampled_traces(
        receiver: OtlpReceiver) -> None:
    sink = _sink(receiver, sample=0.0)
    sink.write(_line(host="plain.test"))  # the one a ratio of 0 leaves out
    sink.write(_line(host="refused.test", decision="deny", error="policy_denied"))
    sink.write(_line(host="inference.test", usage=USAGE, models=["m"]))
    sink.write(_line(host="mcp.test", mcp=[{"method": "tools/list", "name": None,
                                            "decision": "allow"}]))
    sink.write(_line(host="sampled.test", trace=f"00-{TRACE}-00f067aa0ba902b7-01"))
    sink.close()
    hosts = {s["attributes"]["server.address"] for s in receiver.spans()}
    assert hosts == {"refused.test", "inference.test", "mcp.test", "sampled.test"}
    assert len(receiver.logs()) == 5  # (log records are the audit trail: never sampled)


def test_a_line_not_taken_is_dropped_and_counted(receiver: OtlpReceiver) -> None:
    sink = _sink(receiver, queue=2)
    sink.close()
    before = metrics.TELEMETRY_DROPPED._value.get()
    sink.write(_line())  # (after the stop: counted, never raised)
    assert sink.dropped == 1
    assert metrics.TELEMETRY_DROPPED._value.get() == before + 1


def test_a_bad_line_is_logged_and_the_export_goes_on(receiver: OtlpReceiver,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    sink = _sink(receiver)
    sink.write(_line(duration_ms="not a number"))
    sink.write(_line(host="next.test"))
    sink.close()
    assert [s["name"] for s in receiver.spans()] == ["POST next.test"]
    assert "could not be exported" in caplog.text


@pytest.mark.parametrize(("config", "imported"), [
    ("", False), ("telemetry: {endpoint: 'http://127.0.0.1:9'}", True)])
def test_the_sdk_is_imported_only_when_configured(tmp_path: Any, config: str,
                                                   imported: bool) -> None:
    """A gateway started without `telemetry.endpoint` never imports the SDK."""
    (tmp_path / "gateway.yaml").write_text(config + "\n")
    script = (
        "import sys, asyncio\n"
        "from gateway.config import load_config\n"
        "from gateway.runtime.app import Gateway\n"
        f"cfg = load_config({str(tmp_path / 'gateway.yaml')!r}, env={{}})\n"
        "gw = Gateway(cfg)\n"
        "sink = gw._otel_sink()\n"
        "print('opentelemetry.sdk' in sys.modules, sink is not None)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(imported), str(imported)]
