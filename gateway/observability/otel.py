"""OpenTelemetry export of the audit trail, in the exporter process (`telemetry:`).

Every exchange, tunnel and refusal of every engine ends in one audit line
(`gateway/core/audit.py`). The worker hands each serialised line to its exporter process
(`otel_feed.py`, `otel_process.py`); there (`otel_export.py`) this module turns it into

* **a span** (start: the line's start, end: its time; kind SERVER) named ``CONNECT host``,
  ``POST host``, or on an inference call ``chat gpt-4o`` (GenAI conventions), with the
  decision, rule, refusal code (``error.type``), policy and its revision, sandbox, workload,
  engine and path taken; inference calls add ``gen_ai.*`` from the line's ``usage``; each
  MCP tool call of the line's ``mcp`` is a child span ``tools/call <tool>``
  (``gen_ai.operation.name: execute_tool``, ``gen_ai.tool.name``). A line with a valid W3C
  ``trace`` (the request's ``traceparent``) continues that trace: its span's parent is the
  sandbox's span. The gateway adds no trace header to requests it forwards, except to
  the hosts of `telemetry.propagate`: there the request leaves with the gateway's span as
  its `traceparent`, and the line's ``trace_sent`` gives that span its ids.
* **a log record** (``audit.otlp``) whose body is the JSON line itself (the same text as
  the JSON sink's), with a few attributes to filter on, in the span's trace;
* **GenAI metrics**: ``gen_ai.client.token.usage``, ``gen_ai.client.operation.duration``
  and ``gen_ai.client.operation.time_to_first_chunk`` histograms.

Never a header value, body, prompt or completion from the line (it carries none); the
content a policy opted into (`telemetry: {content: true}`) comes beside the line,
already redacted by the worker.

Spans and log records are encoded straight to OTLP protobuf bytes (`otel_encode.py`: the
SDK's objects cost several times as much a line), a common line's from its cached shape
(`otel_shape.py`: neither inference, nor MCP, nor content; the same bytes, for a fraction
of the work), and sent in batches (`otel_send.py`);
the SDK aggregates the metric histograms; the content a policy opted into is read as
attributes by `otel_content.py`. This module, and with it the SDK, is imported only in
the exporter process (never in a worker), started only when `telemetry.endpoint` is set.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource

from gateway.observability import otel_encode as otlp
from gateway.observability import otel_shape
from gateway.observability.otel_content import content_attributes, tool_calls
from gateway.observability.otel_names import operation, request_model, span_name
from gateway.observability.otel_send import Sender

__all__ = ["TTFC", "TTFC_METRIC", "OtelExport"]

log = logging.getLogger("sandbox_gateway")

SCOPE = "sandbox_gateway"
_ENCODE = json.JSONEncoder(separators=(",", ":"), default=str).encode
_DECODE = msgspec.json.Decoder().decode
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
# it); each costs the exporter CPU, so what the log record has is not repeated (the
# listener, byte counts, scheme and port), and the reason only on a refusal
_SPAN_FIELDS = (("decision", "sandbox_gateway.decision"), ("rule", "sandbox_gateway.rule"),
                ("policy", "sandbox_gateway.policy"),
                ("policy_rev", "sandbox_gateway.policy_revision"),
                ("sandbox", "sandbox_gateway.sandbox"), ("engine", "sandbox_gateway.engine"),
                ("path_taken", "sandbox_gateway.path_taken"),
                ("credential", "sandbox_gateway.credential"),
                ("method", "http.request.method"), ("host", "server.address"),
                ("path", "url.path"), ("status", "http.response.status_code"))
# time to first token: the GenAI conventions' span attribute (seconds) and client metric
TTFC = "gen_ai.response.time_to_first_chunk"
TTFC_METRIC = "gen_ai.client.operation.time_to_first_chunk"


class OtelExport:
    """Builds spans and log records from audit lines as OTLP messages (`otel_encode`)
    and sends them in batches (`otel_send`); GenAI metrics through the SDK's meter
    (aggregated histograms). See the module docstring."""

    def __init__(self, *, endpoint: str, protocol: str = "grpc",
                 headers: Mapping[str, str] | None = None, traces: bool = True,
                 logs: bool = False, metrics_on: bool = True,
                 service_name: str = "sandbox-gateway", queue: int = 8192,
                 metrics_interval: float = 60.0, worker: int | None = None) -> None:
        attrs: dict[str, Any] = {"service.name": service_name}
        if worker is not None:
            attrs["sandbox_gateway.worker"] = worker
        res = otlp.resource(attrs)
        sent = dict(headers or {})
        self._shapes = otel_shape.Shapes()
        self._spans: Sender | None = None
        self._logs: Sender | None = None
        self._meter_provider: MeterProvider | None = None
        self._tokens: Any = None
        self._duration: Any = None
        self._first_chunk: Any = None
        if traces:
            self._spans = Sender("traces", protocol, endpoint, sent, lambda spans:
                                 otlp.traces_request(res, SCOPE, spans), queue)
        if logs:
            self._logs = Sender("logs", protocol, endpoint, sent, lambda records:
                                otlp.logs_request(res, SCOPE, records), queue)
        if metrics_on:
            self._metrics(Resource.create(attrs), _metric_exporter(protocol, endpoint, sent),
                          metrics_interval)

    def _metrics(self, resource: Resource, exporter: Any, interval: float) -> None:
        reader = PeriodicExportingMetricReader(exporter,
                                               export_interval_millis=interval * 1000)
        seconds = ExplicitBucketHistogramAggregation(_DURATION_BUCKETS)
        self._meter_provider = MeterProvider(resource=resource, metric_readers=[reader], views=[
            View(instrument_name="gen_ai.client.operation.duration", aggregation=seconds),
            View(instrument_name=TTFC_METRIC, aggregation=seconds),
            View(instrument_name="gen_ai.client.token.usage",
                 aggregation=ExplicitBucketHistogramAggregation(_TOKEN_BUCKETS))])
        meter = self._meter_provider.get_meter(SCOPE)
        self._tokens = meter.create_histogram(
            "gen_ai.client.token.usage", unit="{token}",
            description="Tokens used per inference call, by gen_ai.token.type")
        self._duration = meter.create_histogram(
            "gen_ai.client.operation.duration", unit="s",
            description="Duration of inference calls through the gateway")
        self._first_chunk = meter.create_histogram(
            TTFC_METRIC, unit="s",
            description="Time from the request to the first chunk of a streamed answer")

    def emit(self, line: Mapping[str, Any], end: int, traced: bool = True,
             provider: str | None = None, content: Mapping[str, Any] | None = None,
             raw: bytes | None = None) -> None:
        """One audit line (ended at `end`, ns): its span when `traced`, its log record
        with `audit.otlp`, its metric points on an inference call. `provider`:
        ``gen_ai.provider.name`` (the worker knows the credential's preset); `content`:
        the redacted content a policy opted into; `raw`: the line's JSON text as the
        sink wrote it (the log record's body; else `line` serialised again). A common
        line goes by its shape (`otel_shape`), the others by `general`."""
        try:
            common: otel_shape.Line | None = msgspec.convert(line, otel_shape.Line)
        except msgspec.ValidationError:  # (a field not as the sink writes it: general)
            common = None
        if common is None or not self._common(common, end, traced, content, raw, line):
            self.general(line, end, traced, provider, content, raw)

    def emit_json(self, raw: bytes, end: int, traced: bool = True,
                  provider: str | None = None,
                  content: Mapping[str, Any] | None = None) -> None:
        """`emit` for a line given as its JSON text `raw` (the exporter's loop): parsed
        once, into `otel_shape.Line` (the fields the export reads), and emitted by its
        shape when it has one, else by `general`. Raises ValueError (msgspec's
        DecodeError) on a line that is not JSON."""
        try:
            line: otel_shape.Line | None = otel_shape.decode(raw)
        except msgspec.ValidationError:  # (a field not as the sink writes it: general)
            line = None
        if line is not None and self._common(line, end, traced, content, raw, None):
            return
        self.general(_DECODE(raw) if line is None else msgspec.structs.asdict(line), end,
                     traced, provider, content, raw)

    def emit_many(self, raws: Sequence[bytes], ends: list[int], flags: Sequence[bytes],
                  extras: list[bytes], other: Callable[[int], None]) -> None:
        """A datagram's lines (`otel_export.take`), in order: their JSON texts `raws`,
        ends (ns) and flags (``T``: a span); all read at once (`otel_shape.decode_many`),
        a common one emitted here as `_common` emits it, any other (its frame's provider or
        content, `extras`, not empty; inference, MCP, a sandbox's trace) by `other(i)`
        (`emit_json`, the frame alone). Raises ValueError, nothing emitted, when one of
        the lines is not JSON or not as the sink writes it (then each goes alone)."""
        try:
            lines = otel_shape.decode_many(b"[" + b",".join(raws) + b"]")
        except msgspec.DecodeError as exc:  # (ValidationError is one)
            raise ValueError(str(exc)) from None
        spans, logs = self._spans, self._logs
        of, new_ids = self._shapes.of, otel_shape.new_ids
        span, log_record = otel_shape.span, otel_shape.log_record
        built: list[bytes] = []  # (spans, handed to their sender at once)
        records: list[bytes] = []
        for i, line in enumerate(lines):
            if extras[i] or line.usage is not None or line.mcp is not None or \
                    line.trace is not None or line.trace_sent is not None:
                self._hand(built, records)  # (what came before it goes first)
                other(i)
                continue
            end, shape = ends[i], of(line)
            trace = own = b""
            if spans is not None and flags[i] == b"T":
                trace, own = new_ids()
                built.append(span(shape, line, trace, own, b"",
                                  end - int((line.duration_ms or 0) * 1_000_000), end))
            if logs is not None:
                records.append(log_record(shape, raws[i], end, trace, own))
        self._hand(built, records)

    def _hand(self, spans: list[bytes], records: list[bytes]) -> None:
        """Spans and log records built, to their senders (the lists emptied)."""
        if self._spans is not None and spans:
            self._spans.extend(spans)
            spans.clear()
        if self._logs is not None and records:
            self._logs.extend(records)
            records.clear()

    def _common(self, line: otel_shape.Line, end: int, traced: bool,
                content: Mapping[str, Any] | None, raw: bytes | None,
                whole: Mapping[str, Any] | None) -> bool:
        """A line that is neither an inference call, nor MCP, nor carries content, nor
        an odd trace: its span and log record from its shape (True); else False, nothing
        done. `raw`: its JSON text (else `whole` serialised, for the log record)."""
        if line.usage is not None or line.mcp is not None or content:
            return False
        parent = otlp.parent_of(line.trace)
        if parent is not None and (len(parent[0]) != 16 or len(parent[1]) != 8):
            return False
        sent = _sent(line.trace_sent)
        start = end - int((line.duration_ms or 0) * 1_000_000)
        shape = self._shapes.of(line)
        trace, own = (parent[0] if parent else b""), b""
        if sent is not None:  # (the ids the gateway sent upstream: the upstream's parent)
            trace, own = sent
        elif self._spans is not None and traced:
            trace, own = otel_shape.ids(parent)
        if self._spans is not None and traced:
            self._spans.add(otel_shape.span(shape, line, trace, own,
                                            parent[1] if parent else b"", start, end))
        if self._logs is not None:
            if raw is None:
                raw = _ENCODE(whole).encode("utf-8", "surrogatepass")
            self._logs.add(otel_shape.log_record(shape, raw, end, trace,
                                                 own or (parent[1] if parent else b"")))
        return True

    def general(self, line: Mapping[str, Any], end: int, traced: bool = True,
                provider: str | None = None, content: Mapping[str, Any] | None = None,
                raw: bytes | None = None) -> None:
        """`emit` for any line (inference calls, MCP, content: what has no shape), the
        span's and log record's attributes gathered from the line and encoded each."""
        start = end - int(float(line.get("duration_ms") or 0) * 1_000_000)
        usage = line.get("usage") if isinstance(line.get("usage"), Mapping) else None
        op = operation(line.get("path"), usage)
        attrs = self._attributes(line, usage, op, provider if op else None)
        parent = otlp.parent_of(line.get("trace"))
        trace_id, own = (parent[0] if parent else otlp.trace_id()), b""
        sent = _sent(line.get("trace_sent"))
        if sent is not None:  # (the ids the gateway sent upstream: the upstream's parent)
            trace_id, own = sent
        elif self._spans is not None and traced:
            own = otlp.span_id()
        if self._spans is not None and traced:
            span_attrs = attrs if not content else {**attrs, **content_attributes(content, op)}
            error = line.get("error")
            self._spans.add(otlp.span(span_name(line), otlp.SERVER, trace_id, own,
                                      parent[1] if parent else b"", start, end, span_attrs,
                                      str(error) if error else None))
            self._tools(trace_id, own, line, start, end, content)
        if self._logs is not None:
            self._logs.add(otlp.log_record(
                raw if raw is not None else _ENCODE(line), end,
                {k: attrs[k] for k in _LOG_KEYS if k in attrs},
                line.get("decision") == "deny", trace_id if own or parent else b"",
                own or (parent[1] if parent else b"")))
        if op is not None and self._tokens is not None and usage is not None:
            base: dict[str, Any] = {k: attrs[k] for k in _METRIC_KEYS if k in attrs}
            for kind, key in (("input", "input_tokens"), ("output", "output_tokens")):
                if isinstance(usage.get(key), int):
                    self._tokens.record(usage[key], {**base, "gen_ai.token.type": kind})
            self._duration.record((end - start) / 1e9, base)
            if TTFC in attrs:
                self._first_chunk.record(attrs[TTFC], base)

    def tick(self) -> None:
        """Send the batches that waited long enough (the exporter's loop, when idle)."""
        for sender in (self._spans, self._logs):
            if sender is not None:
                sender.tick()

    def drops(self) -> dict[str, int]:
        """Spans and log records dropped so far, as ``{"traces/unreachable": n, ...}``."""
        return {f"{sender.kind}/{reason}": count for sender in (self._spans, self._logs)
                if sender is not None for reason, count in dict(sender.drops).items()}

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
            model = request_model(line)
            if model:
                attrs["gen_ai.request.model"] = model
            if isinstance(usage.get("model"), str):
                attrs["gen_ai.response.model"] = usage["model"]
            for key in ("input_tokens", "output_tokens"):
                if isinstance(usage.get(key), int):
                    attrs[f"gen_ai.usage.{key}"] = usage[key]
            if isinstance(usage.get("cost_usd"), int | float):
                attrs["sandbox_gateway.cost_usd"] = usage["cost_usd"]
            first = usage.get("first_chunk_ms")
            if isinstance(first, int | float) and not isinstance(first, bool):
                attrs[TTFC] = first / 1000
        return attrs

    def _tools(self, trace_id: bytes, parent: bytes, line: Mapping[str, Any], start: int,
               end: int, content: Mapping[str, Any] | None) -> None:
        """The line's MCP tool calls, as child tool-execution spans (with the arguments
        and result the content exported holds)."""
        calls = line.get("mcp")
        if not isinstance(calls, list) or self._spans is None:
            return
        tools = tool_calls(content) if content else {}
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
            if isinstance(name, str) and name in tools:
                attrs.update(tools[name])
            error = None
            if call.get("decision") == "deny":
                error = "mcp_denied"
                attrs["error.type"] = line.get("error") or "mcp_denied"
            self._spans.add(otlp.span(f"tools/call {name}" if name else "tools/call",
                                      otlp.CLIENT, trace_id, otlp.span_id(), parent, start,
                                      end, attrs, error))

    def close(self, timeout: float = 5.0) -> None:
        """Export what is built (at most `timeout` seconds each), then stop."""
        for sender in (self._spans, self._logs):
            if sender is not None:
                sender.close(timeout)
        if self._meter_provider is not None:
            self._meter_provider.shutdown(timeout_millis=timeout * 1000)


def _sent(trace_sent: Any) -> tuple[bytes, bytes] | None:
    """(trace id, span id) of the `traceparent` the gateway sent upstream in the line's
    exchange (its `trace_sent`, `telemetry.propagate`): its span's own ids; None: none."""
    sent = otlp.parent_of(trace_sent) if isinstance(trace_sent, str) else None
    if sent is None or len(sent[0]) != 16 or len(sent[1]) != 8:
        return None
    return sent[0], sent[1]


def _metric_exporter(protocol: str, endpoint: str, headers: dict[str, str]) -> Any:
    """The SDK's OTLP metric exporter for `protocol` (its module imported here)."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter,
        )
        return OTLPMetricExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"),
                                  headers=tuple(headers.items()) or None)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
        OTLPMetricExporter as HttpMetrics,
    )
    return HttpMetrics(endpoint=f"{endpoint}/v1/metrics", headers=headers)
