"""The worker's side of the OpenTelemetry export: its audit lines, as it wrote them, handed
to its exporter process (`otel_process.py`) without ever waiting for it.

The worker serialises each audit line for the JSON sink anyway (`audit.Auditor.write`);
this tap (`Auditor.tap`) queues those bytes behind a short header. A common line (no
GenAI usage, no content, and a flag that sampling cannot change: `telemetry.sample: 1`,
or spans off) costs two list appends and two counts: nothing parsed or encoded again.
The other lines take `_frame`: sampling (`telemetry.sample` below 1: it needs only the
line's decision, usage, MCP and trace), the GenAI provider (the credential's preset,
which only the worker knows), the content a policy opted into. Every `FLUSH` seconds (or
at once past `BATCH` bytes) what is queued is joined and goes to the exporter as one
datagram (one `send`) on a non-blocking unix SOCK_SEQPACKET socket. Building spans, log
records and metric points, protobuf encoding and gRPC all happen in the exporter
process, so they never take this process's GIL.

Bounded and non-blocking: the kernel's socket buffer, then at most `telemetry.queue`
frames here; a frame past that, one too large for a datagram, or one for an exporter
that is gone (restarting) is dropped and counted (`sandbox_gateway_telemetry_dropped_total`
by reason, `dropped`). A request never waits for telemetry. What the exporter itself
drops comes back on the same socket (`otel_process.ExporterProcess.reports`).

A frame: ``flags 0x1f end_ns 0x1f provider 0x1f content 0x1f line`` where flags is ``T``
(a span) or ``-``, `content` is empty or the JSON of what the policy opted into
(`telemetry: {content: true}`, redacted), and `line` the JSON line with its newline.
JSON escapes control characters, so neither 0x1f nor a newline occurs inside a field.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import random
import socket
from collections.abc import Callable
from typing import Any

from gateway.observability import metrics
from gateway.observability.otel_names import always_traced, operation, provider_name

__all__ = ["BATCH", "FLUSH", "MAX_DATAGRAM", "SEP", "OtelFeed"]

log = logging.getLogger("sandbox_gateway")

# seconds a frame waits for others: one send per batch, not per line, and few wake-ups of
# the exporter (each costs it more than a line: its caches refilled after the worker's)
FLUSH = 0.2
BATCH = 160 * 1024  # bytes that are sent at once without waiting (< MAX_DATAGRAM)
MAX_DATAGRAM = 200 * 1024  # a batch is cut into datagrams of at most this (SO_SNDBUF is more)
SNDBUF = 4 << 20  # asked for; the kernel caps it at net.core.wmem_max
SEP = b"\x1f"
_ENCODE = json.JSONEncoder(separators=(",", ":"), default=str).encode


class OtelFeed:
    """Frames audit lines for the exporter process (see the module docstring)."""

    def __init__(self, *, traces: bool = True, logs: bool = False, metrics_on: bool = True,
                 sample: float = 1.0, queue: int = 8192,
                 preset_of: Callable[[str | None], str | None] = lambda _c: None) -> None:
        self.traces = traces
        self.logs = logs
        self.metrics_on = metrics_on
        self.sample = sample
        self.queue = queue
        self.preset_of = preset_of
        # the content of the line being written (`telemetry: {content: true}`, redacted),
        # set around the JSON sink's write by `with_content`
        self.content: dict[str, str] | None = None
        self.sock: socket.socket | None = None  # (None: no exporter now; frames dropped)
        self.dropped = 0
        self.sent = 0  # frames handed to the exporter
        # the frames waiting, in parts (a header and a line, or a whole frame) joined when
        # sent, each frame ending in its line's newline; how many, and about how many bytes
        self._parts: list[bytes] = []
        self.waiting = 0
        self._size = 0
        self._timer: asyncio.TimerHandle | None = None
        # a common line's header (`tap`), when its flag does not depend on the line: every
        # line traced (sample 1), or none (spans off: sent for the log record)
        self._head: bytes | None = None
        if traces and sample >= 1.0:
            self._head = b"T" + SEP + b"%d" + SEP + SEP + SEP
        elif not traces and logs:
            self._head = b"-" + SEP + b"%d" + SEP + SEP + SEP

    # -- on the event loop ---------------------------------------------------------------

    def tap(self, record: dict[str, Any], now: float, line: bytes) -> None:
        """An audit line the JSON sink wrote (`Auditor.tap`): queued for the exporter.
        Never blocks, never raises into the trail. A common line costs two appends."""
        head = self._head
        if head is None or self.content is not None or record.get("usage") is not None:
            self._frame(record, now, line)
            return
        if self.waiting >= self.queue:
            self._drop(1, "queue_full")
            return
        parts = self._parts
        parts.append(head % (now * 1e9))
        parts.append(line)
        self.waiting += 1
        self._size += len(line)
        if self._size >= BATCH:
            self.flush()
        elif self._timer is None:
            self._arm()

    def _frame(self, record: dict[str, Any], now: float, line: bytes) -> None:
        """`tap` for a line that needs more than its bytes: sampling, the GenAI provider,
        content."""
        traced = self.traces and (self.sample >= 1.0 or always_traced(record)
                                  or random.random() < self.sample)  # noqa: S311
        usage = record.get("usage")
        if not traced and not self.logs and (not self.metrics_on or usage is None):
            return  # (no span, no log record, no metric point)
        if self.waiting >= self.queue:
            self._drop(1, "queue_full")
            return
        provider = b""
        if usage is not None and operation(record.get("path"), usage) is not None:
            provider = (provider_name(self.preset_of(record.get("credential"))) or
                        "").encode()
        content = _ENCODE(self.content).encode() if self.content and traced else b""
        frame = b"".join((b"T" if traced else b"-", SEP, b"%d" % int(now * 1e9), SEP,
                          provider, SEP, content, SEP, line))
        self._parts.append(frame)
        self.waiting += 1
        self._size += len(frame)
        if self._size >= BATCH:
            self.flush()
        elif self._timer is None:
            self._arm()

    def _arm(self) -> None:
        """Flush in FLUSH seconds (without a loop: a command, a unit test: now)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._timer = loop.call_later(FLUSH, self.flush)

    def with_content(self, write: Callable[[dict[str, Any]], None],
                     redact: Callable[[str], str], record: dict[str, Any],
                     content: dict[str, str]) -> None:
        """Write `record` with `write` (the JSON sink, whose tap is `tap`), its frame
        carrying `content` (`Trail.content_sink`: a policy with `telemetry: {content:
        true}`) with `redact` applied (the log's redaction: keys, tokens)."""
        self.content = {key: redact(value) for key, value in content.items()}
        try:
            write(record)
        finally:
            self.content = None

    def flush(self) -> None:
        """Send what is queued: joined, as one datagram, or cut at frames into
        datagrams of at most MAX_DATAGRAM bytes; what the socket does not take now stays
        queued (bounded by `queue`). A frame larger than the socket takes is dropped; so
        is everything when the exporter is gone."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.waiting:
            return
        if self.sock is None:
            self._drop(self.waiting, "exporter_down")
            self._clear()
            return
        buffer = b"".join(self._parts)
        start, sent = 0, 0
        while start < len(buffer):
            end, count = _datagram(buffer, start, self.waiting - sent)
            try:
                self.sock.send(buffer if start == 0 and end == len(buffer) else
                               memoryview(buffer)[start:end])
                self.sent += count
            except BlockingIOError:  # the exporter is behind: the rest stays queued
                break
            except OSError as exc:
                reason = "too_large"
                if exc.errno != errno.EMSGSIZE:  # the exporter is gone (it restarts)
                    self.detach()
                    end, count, reason = len(buffer), self.waiting - sent, "exporter_down"
                self._drop(count, reason)
            start, sent = end, sent + count
        if start == len(buffer):
            self._clear()
        else:  # (kept as one part)
            self._parts = [buffer[start:]]
            self.waiting -= sent
            self._size = len(buffer) - start
        if self.waiting and self._timer is None:
            with contextlib.suppress(RuntimeError):  # (no loop: the next line sends)
                self._timer = asyncio.get_running_loop().call_later(FLUSH, self.flush)

    def detach(self) -> None:
        """Stop sending to the current exporter (it is gone; a new one attaches)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _drop(self, count: int, reason: str) -> None:
        self.dropped += count
        metrics.child(metrics.TELEMETRY_DROPPED, reason).inc(count)

    def _clear(self) -> None:
        self._parts = []
        self.waiting = self._size = 0


def _datagram(buffer: bytes, start: int, left: int) -> tuple[int, int]:
    """(end, frames) of the datagram that starts at `start`: whole frames up to
    MAX_DATAGRAM bytes (at least one, whatever its size); `left` frames from `start` to
    the end of the buffer."""
    if len(buffer) - start <= MAX_DATAGRAM:
        return len(buffer), left
    end = buffer.rfind(b"\n", start, start + MAX_DATAGRAM) + 1
    if end <= start:  # (one frame larger than a datagram: alone)
        end = buffer.find(b"\n", start) + 1 or len(buffer)
    return end, buffer.count(b"\n", start, end)
