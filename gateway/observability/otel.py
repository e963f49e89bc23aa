"""OpenTelemetry export of the audit trail: a sink beside the JSON one (`telemetry:`).

Every exchange, tunnel and refusal of every engine ends in one audit line
(`gateway/core/audit.py`); this sink turns each line into

* **a span** (start: the line's start, end: its time; kind SERVER) named ``CONNECT host``,
  ``POST host``, or on an inference call ``chat gpt-4o`` (GenAI conventions), with the
  decision, rule, refusal code (``error.type``), policy and its revision, sandbox, workload,
  engine and path taken; inference calls add ``gen_ai.*`` from the line's ``usage``; each
  MCP tool call of the line's ``mcp`` is a child span ``tools/call <tool>``
  (``gen_ai.operation.name: execute_tool``, ``gen_ai.tool.name``). A line with a valid W3C
  ``trace`` (the request's ``traceparent``) continues that trace: its span's parent is the
  sandbox's span. The gateway adds no trace header to requests it forwards.
* **a log record** (``audit.otlp``) whose body is the JSON line itself (the same text as
  the JSON sink's), with a few attributes to filter on, in the span's trace;
* **GenAI metrics**: ``gen_ai.client.token.usage`` and ``gen_ai.client.operation.duration``
  histograms.

Never a header value, body, prompt or completion: only the line's fields, which carry none.

**Sampled** (`telemetry.sample`, a ratio): the spans of allowed requests that are not
inference or MCP calls, and whose sandbox did not sample its trace; refusals, inference
and MCP calls always have theirs. Log records and metrics are never sampled.

**Off the hot path.** `write` appends the line to a bounded queue (`telemetry.queue`) and
returns; a daemon thread builds spans, logs and metric points, and the SDK's batch
processors export them from their own threads. A line that does not fit is dropped and
counted (`sandbox_gateway_telemetry_dropped_total`). The SDK is imported only here, and
this module only when `telemetry.endpoint` is set.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry._logs import LogRecord, SeverityNumber
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)

from gateway.observability import metrics

__all__ = ["OtelSink", "operation", "provider_name", "span_name"]

log = logging.getLogger("sandbox_gateway")

SCOPE = "sandbox_gateway"
# The export thread takes the queued lines every DRAIN seconds, or at once when WAKE are
# queued: a wake-up (a thread switch) per line would cost the event loop more than the line.
DRAIN = 0.2
WAKE = 256
_ENCODE = json.JSONEncoder(separators=(",", ":"), default=str).encode
# gen_ai.provider.name (the GenAI conventions' well-known values) by credential preset.
_PROVIDERS = {"openai": "openai", "anthropic": "anthropic", "gemini": "gcp.gemini",
              "vertex": "gcp.vertex_ai", "azure-openai": "azure.ai.openai",
              "azure_openai": "azure.ai.openai", "bedrock": "aws.bedrock",
              "mistral": "mistral_ai", "groq": "groq", "deepseek": "deepseek",
              "cohere": "cohere", "xai": "x_ai", "perplexity": "perplexity"}
# the conventions' advised buckets (seconds; tokens)
_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
                     20.48, 40.96, 81.92)
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304,
                  16777216, 67108864)
# the log record's attributes (its body is the whole line): what log queries filter on
_LOG_KEYS = ("sandbox_gateway.decision", "sandbox_gateway.policy", "sandbox_gateway.sandbox",
             "error.type", "server.address", "gen_ai.operation.name")
_METRIC_KEYS = ("gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model",
                "gen_ai.response.model", "server.address", "error.type")
# the line's scalar fields as span attributes (sandbox_gateway.* unless a convention names
# it); each costs the export thread CPU, so what the log record has is not repeated (the
# listener, byte counts, scheme and port), and the reason only on a refusal
_SPAN_FIELDS = (("decision", "sandbox_gateway.decision"), ("rule", "sandbox_gateway.rule"),
                ("policy", "sandbox_gateway.policy"),
                ("policy_rev", "sandbox_gateway.policy_revision"),
                ("sandbox", "sandbox_gateway.sandbox"), ("engine", "sandbox_gateway.engine"),
                ("path_taken", "sandbox_gateway.path_taken"),
                ("credential", "sandbox_gateway.credential"),
                ("method", "http.request.method"), ("host", "server.address"),
                ("path", "url.path"), ("status", "http.response.status_code"))


def operation(path: str | None, usage: Mapping[str, Any] | None) -> str | None:
    """``gen_ai.operation.name`` of an inference call to `path` (None: not one)."""
    if usage is None:
        return None
    path = path or ""
    if "embed" in path:
        return "embeddings"
    if ":generateContent" in path or ":streamGenerateContent" in path:
        return "generate_content"
    if path.endswith("/completions") and not path.endswith("/chat/completions"):
        return "text_completion"
    return "chat"


def provider_name(preset: str | None) -> str | None:
    """``gen_ai.provider.name`` for a credential's preset."""
    return None if preset is None else _PROVIDERS.get(preset, preset)


def span_name(line: Mapping[str, Any]) -> str:
    """``chat gpt-4o`` for an inference call, else ``METHOD host`` (``CONNECT host``)."""
    usage = line.get("usage")
    op = operation(line.get("path"), usage)
    if op is not None:
        model = _request_model(line)
        return f"{op} {model}" if model else op
    method = line.get("method")
    host = line.get("host")
    if method and host:
        return f"{method} {host}"
    return str(method or line.get("listener") or "connection")


def _request_model(line: Mapping[str, Any]) -> str | None:
    models = line.get("models")
    if isinstance(models, list) and models and isinstance(models[0], str):
        return models[0]
    usage = line.get("usage")
    model = usage.get("model") if isinstance(usage, Mapping) else None
    return model if isinstance(model, str) else None


def parent_of(trace_header: str | None) -> Any:
    """The OpenTelemetry context whose span is the sandbox's (`trace`: a traceparent the
    core checked), or None."""
    if not trace_header:
        return None
    parts = trace_header.split("-")
    try:
        ctx = SpanContext(int(parts[1], 16), int(parts[2], 16), is_remote=True,
                          trace_flags=TraceFlags(int(parts[3][:2], 16) & 1))
    except (IndexError, ValueError):
        return None
    return trace.set_span_in_context(NonRecordingSpan(ctx))


def _always(line: Mapping[str, Any]) -> bool:
    """Whether `line`'s span is exported whatever `telemetry.sample` says: a refusal (or
    any decision but allow), an inference call, an MCP message, or a request whose
    sandbox sampled its trace (the traceparent's sampled flag)."""
    trace_header = line.get("trace")
    return (line.get("decision") != "allow" or line.get("usage") is not None
            or line.get("mcp") is not None
            or (isinstance(trace_header, str) and int(trace_header[-1], 16) & 1 == 1))


class OtelSink:
    """Exports audit lines over OTLP (see the module docstring)."""

    def __init__(self, *, endpoint: str, protocol: str = "grpc",
                 headers: Mapping[str, str] | None = None, traces: bool = True,
                 logs: bool = False, metrics_on: bool = True,
                 service_name: str = "sandbox-gateway", queue: int = 8192,
                 metrics_interval: float = 60.0, worker: int | None = None,
                 sample: float = 1.0,
                 preset_of: Callable[[str | None], str | None] = lambda _c: None) -> None:
        attrs: dict[str, Any] = {"service.name": service_name}
        if worker is not None:
            attrs["sandbox_gateway.worker"] = worker
        resource = Resource.create(attrs)
        exporters = _exporters(protocol, endpoint, dict(headers or {}))
        self.preset_of = preset_of
        self.queue = queue
        self.dropped = 0
        self.sample = sample
        self._lines: deque[tuple[dict[str, Any], int, bool]] = deque()
        self._wake = threading.Event()
        self._closed = False
        self._tracer_provider: TracerProvider | None = None
        self._logger_provider: LoggerProvider | None = None
        self._meter_provider: MeterProvider | None = None
        self._tracer: Any = None
        self._logger: Any = None
        self._tokens: Any = None
        self._duration: Any = None
        if traces:
            self._tracer_provider = TracerProvider(resource=resource)
            self._tracer_provider.add_span_processor(BatchSpanProcessor(
                exporters["traces"](), max_queue_size=queue,
                max_export_batch_size=min(512, queue)))
            self._tracer = self._tracer_provider.get_tracer(SCOPE)
        if logs:
            self._logger_provider = LoggerProvider(resource=resource)
            self._logger_provider.add_log_record_processor(BatchLogRecordProcessor(
                exporters["logs"](), max_queue_size=queue,
                max_export_batch_size=min(512, queue)))
            self._logger = self._logger_provider.get_logger(SCOPE)
        if metrics_on:
            reader = PeriodicExportingMetricReader(
                exporters["metrics"](), export_interval_millis=metrics_interval * 1000)
            self._meter_provider = MeterProvider(resource=resource, metric_readers=[reader],
                                                 views=[
                View(instrument_name="gen_ai.client.operation.duration",
                     aggregation=ExplicitBucketHistogramAggregation(_DURATION_BUCKETS)),
                View(instrument_name="gen_ai.client.token.usage",
                     aggregation=ExplicitBucketHistogramAggregation(_TOKEN_BUCKETS))])
            meter = self._meter_provider.get_meter(SCOPE)
            self._tokens = meter.create_histogram(
                "gen_ai.client.token.usage", unit="{token}",
                description="Tokens used per inference call, by gen_ai.token.type")
            self._duration = meter.create_histogram(
                "gen_ai.client.operation.duration", unit="s",
                description="Duration of inference calls through the gateway")
        self._thread = threading.Thread(target=self._run, name="otel-export", daemon=True)
        self._thread.start()

    # -- on the event loop: only a queue append ------------------------------------------

    def write(self, line: dict[str, Any]) -> None:
        """Queue one audit line for export (never blocks, never raises)."""
        traced = self._tracer is not None and (self.sample >= 1.0 or _always(line)
                                               or random.random() < self.sample)  # noqa: S311
        if not traced and self._logger is None and (self._tokens is None
                                                    or line.get("usage") is None):
            return  # (no span, no log record, no metric point)
        if self._closed or len(self._lines) >= self.queue:
            self.dropped += 1
            metrics.TELEMETRY_DROPPED.inc()
            return
        self._lines.append((line, time.time_ns(), traced))
        if len(self._lines) >= WAKE and not self._wake.is_set():
            self._wake.set()  # (else the thread drains the queue every DRAIN seconds)

    # -- the export thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(DRAIN)
            self._wake.clear()
            while self._lines:
                line, end, traced = self._lines.popleft()
                try:
                    self._emit(line, end, traced)
                except Exception:  # (one bad line never stops the export)
                    log.exception("telemetry: an audit line could not be exported")
            if self._closed:
                return

    def _emit(self, line: dict[str, Any], end: int, traced: bool = True) -> None:
        start = end - int(float(line.get("duration_ms") or 0) * 1_000_000)
        usage = line.get("usage") if isinstance(line.get("usage"), Mapping) else None
        op = operation(line.get("path"), usage)
        provider = provider_name(self.preset_of(line.get("credential"))) if op else None
        attrs = self._attributes(line, usage, op, provider)
        context = parent_of(line.get("trace"))
        span_ctx: Any = None
        if self._tracer is not None and traced:
            span = self._tracer.start_span(span_name(line), context=context,
                                           kind=SpanKind.SERVER, attributes=attrs,
                                           start_time=start)
            if line.get("error"):
                span.set_status(Status(StatusCode.ERROR, str(line["error"])))
            self._tools(span, line, start, end)
            span.end(end_time=end)
            span_ctx = span.get_span_context()
        if self._logger is not None:
            record = LogRecord(
                timestamp=end, observed_timestamp=end,
                context=trace.set_span_in_context(NonRecordingSpan(span_ctx))
                if span_ctx is not None else context,
                severity_text="INFO" if line.get("decision") != "deny" else "WARN",
                severity_number=SeverityNumber.INFO if line.get("decision") != "deny"
                else SeverityNumber.WARN,
                body=_ENCODE(line), event_name="sandbox_gateway.audit",
                attributes={k: attrs[k] for k in _LOG_KEYS if k in attrs})
            self._logger.emit(record)
        if op is not None and self._tokens is not None and usage is not None:
            base: dict[str, Any] = {k: attrs[k] for k in _METRIC_KEYS if k in attrs}
            for kind, key in (("input", "input_tokens"), ("output", "output_tokens")):
                if isinstance(usage.get(key), int):
                    self._tokens.record(usage[key], {**base, "gen_ai.token.type": kind})
            self._duration.record((end - start) / 1e9, base)

    def _attributes(self, line: Mapping[str, Any], usage: Mapping[str, Any] | None,
                    op: str | None, provider: str | None) -> dict[str, Any]:
        attrs: dict[str, Any] = {name: line[key] for key, name in _SPAN_FIELDS
                                 if line.get(key) is not None}
        if line.get("error"):
            attrs["error.type"] = line["error"]
        if line.get("decision") != "allow" and line.get("reason"):
            attrs["sandbox_gateway.reason"] = line["reason"]
        workload = line.get("workload")
        if isinstance(workload, Mapping):
            for key, value in workload.items():
                if isinstance(value, str | int | float | bool):
                    attrs[f"sandbox_gateway.workload.{key}"] = value
        if op is not None and usage is not None:
            attrs["gen_ai.operation.name"] = op
            if provider:
                attrs["gen_ai.provider.name"] = provider
            model = _request_model(line)
            if model:
                attrs["gen_ai.request.model"] = model
            if isinstance(usage.get("model"), str):
                attrs["gen_ai.response.model"] = usage["model"]
            for key in ("input_tokens", "output_tokens"):
                if isinstance(usage.get(key), int):
                    attrs[f"gen_ai.usage.{key}"] = usage[key]
            if isinstance(usage.get("cost_usd"), int | float):
                attrs["sandbox_gateway.cost_usd"] = usage["cost_usd"]
        return attrs

    def _tools(self, parent: Any, line: Mapping[str, Any], start: int, end: int) -> None:
        """The line's MCP tool calls, as child tool-execution spans."""
        calls = line.get("mcp")
        if not isinstance(calls, list):
            return
        context = trace.set_span_in_context(parent)
        for call in calls:
            if not isinstance(call, Mapping) or call.get("method") != "tools/call":
                continue
            name = call.get("name")
            attrs: dict[str, Any] = {"mcp.method.name": "tools/call",
                                     "gen_ai.operation.name": "execute_tool",
                                     "sandbox_gateway.decision": call.get("decision")}
            if isinstance(name, str):
                attrs["gen_ai.tool.name"] = name
            if line.get("host"):
                attrs["server.address"] = line["host"]
            span = self._tracer.start_span(f"tools/call {name}" if name else "tools/call",
                                           context=context, kind=SpanKind.CLIENT,
                                           attributes=attrs, start_time=start)
            if call.get("decision") == "deny":
                span.set_status(Status(StatusCode.ERROR, "mcp_denied"))
                span.set_attribute("error.type", line.get("error") or "mcp_denied")
            span.end(end_time=end)

    # -- the stop ------------------------------------------------------------------------

    def close(self, timeout: float = 5.0) -> None:
        """Export what is queued (at most `timeout` seconds), then stop (blocking: call it
        from a thread)."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout)
        for provider in (self._tracer_provider, self._logger_provider):
            if provider is not None:
                provider.force_flush(int(timeout * 1000))
                provider.shutdown()
        if self._meter_provider is not None:
            self._meter_provider.shutdown(timeout_millis=timeout * 1000)


def _exporters(protocol: str, endpoint: str,
               headers: dict[str, str]) -> dict[str, Callable[[], Any]]:
    """Constructors of the OTLP exporters for `protocol` (their modules imported here)."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter,
        )
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        insecure = endpoint.startswith("http://")
        grpc_headers = tuple(headers.items()) or None
        return {
            "traces": lambda: OTLPSpanExporter(endpoint=endpoint, insecure=insecure,
                                               headers=grpc_headers),
            "logs": lambda: OTLPLogExporter(endpoint=endpoint, insecure=insecure,
                                            headers=grpc_headers),
            "metrics": lambda: OTLPMetricExporter(endpoint=endpoint, insecure=insecure,
                                                  headers=grpc_headers)}
    from opentelemetry.exporter.otlp.proto.http._log_exporter import (
        OTLPLogExporter as HttpLogs,
    )
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
        OTLPMetricExporter as HttpMetrics,
    )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpans,
    )
    return {
        "traces": lambda: HttpSpans(endpoint=f"{endpoint}/v1/traces", headers=headers),
        "logs": lambda: HttpLogs(endpoint=f"{endpoint}/v1/logs", headers=headers),
        "metrics": lambda: HttpMetrics(endpoint=f"{endpoint}/v1/metrics", headers=headers)}
