"""A real OTLP receiver on 127.0.0.1:0: the OTLP/gRPC services (TraceService, LogsService,
MetricsService from opentelemetry-proto's generated stubs, served by grpcio) and OTLP/HTTP
(`POST /v1/traces|logs|metrics`, protobuf bodies), keeping every export request.

Used instead of the OpenTelemetry Collector binary, which cannot be built here (no Go
module proxy, Go 1.19: docs/observability.md, "Testing"). What arrives is decoded by the
protocol's own message classes, and the raw bytes are kept for secret searches.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

_REQUESTS = {"traces": trace_service_pb2.ExportTraceServiceRequest,
             "logs": logs_service_pb2.ExportLogsServiceRequest,
             "metrics": metrics_service_pb2.ExportMetricsServiceRequest}
_RESPONSES = {"traces": trace_service_pb2.ExportTraceServiceResponse,
              "logs": logs_service_pb2.ExportLogsServiceResponse,
              "metrics": metrics_service_pb2.ExportMetricsServiceResponse}


def value(any_value: AnyValue) -> Any:
    """An OTLP AnyValue as Python."""
    kind = any_value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "kvlist_value":
        return {kv.key: value(kv.value) for kv in any_value.kvlist_value.values}
    if kind == "array_value":
        return [value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind)


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: value(kv.value) for kv in kvs}


class OtlpReceiver:
    """Receives OTLP over gRPC (`grpc_endpoint`) and HTTP (`http_endpoint`), on the
    ports given (a collector back where it was) or on free ones."""

    def __init__(self, grpc_port: int = 0, http_port: int = 0) -> None:
        self.received: dict[str, list[Any]] = {k: [] for k in _REQUESTS}
        self.raw = bytearray()
        self._lock = threading.Lock()
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        receiver = self

        def servicer(kind: str, base: type) -> Any:
            def export(self: Any, request: Any, context: Any) -> Any:
                receiver._keep(kind, request, request.SerializeToString())
                return _RESPONSES[kind]()
            return type(f"{kind}Servicer", (base,), {"Export": export})()

        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(
            servicer("traces", trace_service_pb2_grpc.TraceServiceServicer), self._grpc)
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(
            servicer("logs", logs_service_pb2_grpc.LogsServiceServicer), self._grpc)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(
            servicer("metrics", metrics_service_pb2_grpc.MetricsServiceServicer), self._grpc)
        self.grpc_port = self._grpc.add_insecure_port(f"127.0.0.1:{grpc_port}")
        self._grpc.start()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                kind = self.path.rsplit("/", 1)[-1]
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if kind not in _REQUESTS or self.path != f"/v1/{kind}" or \
                        self.headers.get("content-type") != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver._keep(kind, _REQUESTS[kind].FromString(body), body)
                out = _RESPONSES[kind]().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", http_port), Handler)
        self._http.daemon_threads = True
        self.http_port = self._http.server_address[1]
        self._http_thread = threading.Thread(target=self._http.serve_forever, args=(0.05,),
                                             daemon=True)
        self._http_thread.start()

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def _keep(self, kind: str, request: Any, raw: bytes) -> None:
        with self._lock:
            self.received[kind].append(request)
            self.raw += raw

    def close(self) -> None:
        self._grpc.stop(None).wait()
        self._http.shutdown()
        self._http.server_close()
        self._http_thread.join()

    def __enter__(self) -> OtlpReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what arrived --------------------------------------------------------------------

    def spans(self) -> list[dict[str, Any]]:
        """Every span received: name, kind, ids (hex), attributes, status, times."""
        out = []
        with self._lock:
            requests = list(self.received["traces"])
        for request in requests:
            for rs in request.resource_spans:
                resource = _attrs(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        out.append({
                            "name": span.name, "kind": span.kind,
                            "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                            "parent_span_id": span.parent_span_id.hex(),
                            "attributes": _attrs(span.attributes),
                            "status": span.status.code, "resource": resource,
                            "start": span.start_time_unix_nano,
                            "end": span.end_time_unix_nano})
        return out

    def logs(self) -> list[dict[str, Any]]:
        """Every log record received: body, attributes, ids (hex), event name."""
        out = []
        with self._lock:
            requests = list(self.received["logs"])
        for request in requests:
            for rl in request.resource_logs:
                for sl in rl.scope_logs:
                    for rec in sl.log_records:
                        out.append({"body": value(rec.body), "attributes": _attrs(rec.attributes),
                                    "trace_id": rec.trace_id.hex(),
                                    "span_id": rec.span_id.hex(),
                                    "event_name": rec.event_name,
                                    "severity": rec.severity_text})
        return out

    def metrics(self) -> dict[str, list[dict[str, Any]]]:
        """Metric name → its data points (as protobuf's JSON mapping)."""
        out: dict[str, list[dict[str, Any]]] = {}
        with self._lock:
            requests = list(self.received["metrics"])
        for request in requests:
            for rm in request.resource_metrics:
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        doc = MessageToDict(metric)
                        for kind in ("histogram", "sum", "gauge"):
                            out.setdefault(metric.name, []).extend(
                                doc.get(kind, {}).get("dataPoints", []))
        return out

    def wait(self, check: Callable[[], bool], timeout: float = 15.0) -> bool:
        """Wait until `check()` holds (exports are batched: up to a few seconds)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return True
            time.sleep(0.05)
        return check()
