"""Batches of spans or log records (`otel_encode.py`) exported over OTLP, gRPC or
HTTP/protobuf, from a thread of the exporter process.

The exporter's loop `add`s each message; a batch goes at `BATCH` messages or `DELAY`
seconds after its first (`tick`), to a bounded queue the sending thread takes from (at
most `queue` messages wait; a batch past that is dropped and logged). A failed export is
tried again twice (after 0.5 s, 1 s) when the collector may take it later (gRPC
UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED; HTTP 429, 5xx, no connection),
then dropped and logged. Every message dropped is counted in `drops` by reason
(queue_full, unreachable, refused), which the exporter reports to its worker's /metrics
(`otel_export.Reporter`). A gRPC channel to a collector that was down tries to reconnect
at most every `RECONNECT` seconds, so the export resumes soon after it is back. The
collector's headers go with every export, never to a log.
"""

from __future__ import annotations

import logging
import queue as queues
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import grpc

__all__ = ["BATCH", "DELAY", "Sender"]

log = logging.getLogger("sandbox_gateway")

BATCH = 512
DELAY = 1.0  # seconds a message waits for others (the SDK's batch processors wait 5)
TIMEOUT = 10.0  # one export
RETRIES = (0.5, 1.0)
RECONNECT = 5.0  # the longest wait between a gRPC channel's reconnection attempts
_RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.RESOURCE_EXHAUSTED)
# the OTLP services' Export methods (opentelemetry-proto), called with serialised bytes
_METHODS = {"traces": "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
            "logs": "/opentelemetry.proto.collector.logs.v1.LogsService/Export"}


class Sender:
    """One signal's batches (``kind``: traces or logs) to one collector."""

    def __init__(self, kind: str, protocol: str, endpoint: str, headers: dict[str, str],
                 request: Callable[[list[Any]], bytes], queue: int = 8192) -> None:
        self.kind = kind
        self.request = request  # messages -> the OTLP export request's bytes
        self.drops: dict[str, int] = {}  # messages dropped, by reason
        self._items: list[Any] = []
        self._first = 0.0
        self._queue: queues.Queue[list[Any] | None] = queues.Queue(max(1, queue // BATCH))
        self._export = _grpc(kind, endpoint, headers) if protocol == "grpc" else \
            _http(kind, endpoint, headers)
        self._thread = threading.Thread(target=self._run, name=f"otlp-{kind}", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        return sum(self.drops.values())

    def _drop(self, reason: str, count: int) -> None:
        # (queue_full written by the loop, the others by the thread: one writer a key)
        self.drops[reason] = self.drops.get(reason, 0) + count

    def add(self, item: Any) -> None:
        if not self._items:
            self._first = time.monotonic()
        self._items.append(item)
        if len(self._items) >= BATCH:
            self._flush()

    def extend(self, items: list[Any]) -> None:
        """`add` each of `items`, in one step (batches of BATCH, as `add` cuts them)."""
        if not items:
            return
        if not self._items:
            self._first = time.monotonic()
        self._items += items
        while len(self._items) >= BATCH:
            held, self._items = self._items[BATCH:], self._items[:BATCH]
            self._flush()
            self._items = held
            if held:
                self._first = time.monotonic()

    def tick(self) -> None:
        """Send a batch that waited DELAY seconds."""
        if self._items and time.monotonic() - self._first >= DELAY:
            self._flush()

    def _flush(self) -> None:
        items, self._items = self._items, []
        try:
            self._queue.put_nowait(items)
        except queues.Full:
            self._drop("queue_full", len(items))
            log.warning("telemetry: the collector takes %s more slowly than they come; "
                        "%d dropped", self.kind, len(items))

    def _run(self) -> None:
        while (items := self._queue.get()) is not None:
            data = self.request(items)
            for wait in (*RETRIES, None):
                try:
                    self._export(data)
                    break
                except _Retry as exc:
                    if wait is None:
                        self._drop("unreachable", len(items))
                        log.warning("telemetry: %d %s not exported: %s", len(items),
                                    self.kind, exc)
                    else:
                        time.sleep(wait)
                except Exception as exc:  # (the collector refused them: no retry)
                    self._drop("refused", len(items))
                    log.warning("telemetry: %d %s not exported: %s", len(items), self.kind,
                                exc)
                    break

    def close(self, timeout: float = 5.0) -> None:
        """Send what is held, wait up to `timeout` seconds for the thread to finish."""
        if self._items:
            self._flush()
        try:
            self._queue.put(None, timeout=timeout)
        except queues.Full:
            return
        self._thread.join(timeout)


class _Retry(Exception):
    """An export the collector may take if tried again."""


def _grpc(kind: str, endpoint: str, headers: dict[str, str]) -> Callable[[bytes], None]:
    target = endpoint.split("://", 1)[-1].rstrip("/")
    options = (("grpc.initial_reconnect_backoff_ms", 500),
               ("grpc.max_reconnect_backoff_ms", int(RECONNECT * 1000)))
    channel = grpc.insecure_channel(target, options) if endpoint.startswith("http://") \
        else grpc.secure_channel(target, grpc.ssl_channel_credentials(), options)
    call = channel.unary_unary(_METHODS[kind], request_serializer=None,
                               response_deserializer=None)
    metadata = tuple((k.lower(), v) for k, v in headers.items()) or None

    def export(data: bytes) -> None:
        try:
            call(data, metadata=metadata, timeout=TIMEOUT)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if code in _RETRY_CODES:
                raise _Retry(f"gRPC {code.name}") from None
            raise RuntimeError(f"gRPC {code.name if code else exc}") from None
    return export


def _http(kind: str, endpoint: str, headers: dict[str, str]) -> Callable[[bytes], None]:
    url = f"{endpoint.rstrip('/')}/v1/{kind}"
    sent = {**headers, "Content-Type": "application/x-protobuf"}

    def export(data: bytes) -> None:
        request = urllib.request.Request(url, data=data, headers=sent, method="POST")  # noqa: S310
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT) as answer:  # noqa: S310
                answer.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 429 or exc.code >= 500:
                raise _Retry(f"HTTP {exc.code}") from None
            raise RuntimeError(f"HTTP {exc.code}") from None
        except OSError as exc:  # (no connection, a timeout)
            raise _Retry(type(exc).__name__) from None
    return export
