"""The common audit line's span and log record, encoded from a cached shape, in the
exporter process.

Most audit lines of a gateway repeat the same decision, rule, policy, sandbox, engine,
method and host from line to line; only the path, the status, the times and the ids
change. A line that is neither an inference call, nor MCP, nor carries content (those
take `otel.OtelExport`'s general path) is read into `Line` (its other fields skipped
unread, the JSON parsed once) and its constant part looked up as a `Shape`: the span's
name, its attribute fields before and after the path and status, its status, and the
log record's attributes and severity, all already encoded (`otel_encode`) in the order
the general path writes them, so the bytes are the same (tests/observability/
test_otel_shape.py decodes both with opentelemetry-proto and compares them). What
changes per line is encoded here by hand, in one join.

The fields a shape is made of, and the path and status, are typed as the JSON sink writes
them (strings, a workload of strings, an integer status): a line whose fields differ fails
`Line`'s decoding and takes the general path, so a cache never mixes values that compare
equal but encode differently (``1``, ``1.0``, ``true``). The path and status are
remembered as a pair of encoded attributes (most requests of a gateway go to a few
paths).
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from itertools import chain, repeat
from typing import Any

import msgspec

from gateway.observability import otel_encode as otlp
from gateway.observability.otel_names import span_name

__all__ = ["Line", "Shape", "Shapes", "decode", "decode_many", "ids", "log_record",
           "new_ids", "span"]

_SHAPES_MAX = 4096  # shapes remembered (cleared when full)
_PAIRS_MAX = 8192  # (path, status) attribute pairs remembered (cleared when full)
_IDS_DRAWN = 512  # (trace id, span id) pairs drawn at once
_pairs: dict[tuple[str | None, int | None], bytes] = {}
_MASK64 = (1 << 64) - 1
_TIMES = struct.Struct("<BQBQ").pack  # Span's start (7, fixed64) and end (8, fixed64)
_TIME = struct.Struct("<Q").pack
_ZERO_TRACE, _ZERO_SPAN = bytes(16), bytes(8)
_EVENT = otlp.field(b"\x62", b"sandbox_gateway.audit")  # LogRecord.event_name (12)
# the line's fields before the path and status, as span attributes (otel._SPAN_FIELDS)
_HEAD = (("decision", "sandbox_gateway.decision"), ("rule", "sandbox_gateway.rule"),
         ("policy", "sandbox_gateway.policy"),
         ("policy_rev", "sandbox_gateway.policy_revision"),
         ("sandbox", "sandbox_gateway.sandbox"), ("engine", "sandbox_gateway.engine"),
         ("path_taken", "sandbox_gateway.path_taken"),
         ("credential", "sandbox_gateway.credential"),
         ("method", "http.request.method"), ("host", "server.address"))


class Line(msgspec.Struct):
    """The audit line's fields the export reads (see the module docstring), in the order
    the sink writes them (`core/audit.py`): msgspec matches each key of the text to the
    next field first, so in that order a line's keys are found at the first compare."""

    sandbox: str | None = None
    policy: str | None = None
    listener: str | None = None
    method: str | None = None
    host: str | None = None
    path: str | None = None
    decision: str | None = None
    reason: str | None = None
    rule: str | None = None
    status: int | None = None
    error: str | None = None
    duration_ms: float | None = None
    path_taken: str | None = None
    engine: str | None = None
    credential: str | None = None
    policy_rev: str | None = None
    usage: Any = None
    workload: dict[str, str] | None = None
    mcp: Any = None
    models: Any = None
    trace: Any = None
    trace_sent: Any = None


decode: Callable[[bytes], Line] = msgspec.json.Decoder(Line).decode
# many lines at once: a JSON array of them (`OtelExport.emit_many`), a third cheaper a line
# than one `decode` each (msgspec's set-up per call)
decode_many: Callable[[bytes], list[Line]] = msgspec.json.Decoder(list[Line]).decode


class Shape(msgspec.Struct, frozen=True):
    """A line's constant part, encoded: the span's name field, its attribute fields
    before the path (`head`) and after the status (`tail`: the error, the refusal's
    reason, the workload; then the span's status and flags), the log record's severity
    and attributes."""

    name: bytes
    head: bytes
    tail: bytes
    severity: bytes
    log_attrs: bytes


class Shapes:
    """Shapes by the values they are made of, built on first sight."""

    def __init__(self) -> None:
        self._known: dict[tuple[Any, ...], Shape] = {}
        # the last line's key and shape: a line's values are new strings each time, whose
        # hashes a dict lookup computes again; comparing them to the last key's does not
        # hash (consecutive lines share their shape more often than not)
        self._last: tuple[tuple[Any, ...], Shape | None] = ((), None)

    def of(self, line: Line) -> Shape:
        refused = line.decision != "allow"
        workload = line.workload
        key = (line.decision, line.rule, line.policy, line.policy_rev, line.sandbox,
               line.engine, line.path_taken, line.credential, line.method, line.host,
               line.error, line.reason if refused else None, line.listener,
               tuple(workload.items()) if workload else None)
        last, shape = self._last
        if shape is not None and key == last:
            return shape
        found = self._known.get(key)
        if found is None:
            if len(self._known) >= _SHAPES_MAX:
                self._known.clear()
            found = self._known[key] = _shape(line, refused)
        self._last = (key, found)
        return found


def _shape(line: Line, refused: bool) -> Shape:
    head = {name: getattr(line, key) for key, name in _HEAD}
    tail: dict[str, Any] = {}
    if line.error:
        tail["error.type"] = line.error
    if refused and line.reason:
        tail["sandbox_gateway.reason"] = line.reason
    for key, value in (line.workload or {}).items():
        tail[f"sandbox_gateway.workload.{key}"] = value
    status = otlp.status(line.error) if line.error else b""
    logged = {"sandbox_gateway.decision": line.decision,
              "sandbox_gateway.policy": line.policy, "sandbox_gateway.sandbox": line.sandbox,
              "error.type": line.error or None, "server.address": line.host}
    name = span_name({"method": line.method, "host": line.host, "listener": line.listener})
    return Shape(name=otlp.field(b"\x2a", name.encode("utf-8", "surrogatepass")),
                 head=otlp.attributes(head, b"\x4a"),
                 tail=otlp.attributes(tail, b"\x4a") + status + otlp.SAMPLED,
                 severity=otlp.severity(line.decision == "deny"),
                 log_attrs=otlp.attributes(logged, b"\x32"))


def _draw(_: object = None) -> list[tuple[bytes, bytes]]:
    """`_IDS_DRAWN` (trace id, span id) pairs, random, never all zero (as the SDK's id
    generator makes them: ids, not secrets), cut from one draw (a draw a line cost a
    third of the line's span)."""
    pool = random.randbytes(24 * _IDS_DRAWN)  # noqa: S311  (ids, as the SDK draws them)
    return [(trace if trace != _ZERO_TRACE else otlp.trace_id(),
             own if own != _ZERO_SPAN else otlp.span_id())
            for trace, own in ((pool[at:at + 16], pool[at + 16:at + 24])
                               for at in range(0, len(pool), 24))]


# the next (trace id, span id) of a line without a sandbox's trace: a new draw when the
# last is used up (iterated in C; the exporter's loop only: one thread)
new_ids: Callable[[], tuple[bytes, bytes]] = \
    chain.from_iterable(map(_draw, repeat(None))).__next__


def ids(parent: otlp.Parent | None) -> tuple[bytes, bytes]:
    """(trace id, span id): the sandbox's trace or a new one, and a new span id."""
    trace, own = new_ids()
    return (parent[0], own) if parent is not None else (trace, own)


def span(shape: Shape, line: Line, trace: bytes, own: bytes, parent: bytes, start: int,
         end: int) -> bytes:
    """The line's Span (kind SERVER)."""
    return b"".join((b"\x0a\x10", trace, b"\x12\x08", own,
                     b"\x22\x08" + parent if parent else b"", shape.name, b"\x30\x02",
                     _TIMES(0x39, start & _MASK64, 0x41, end & _MASK64), shape.head,
                     _pairs.get((line.path, line.status)) or _pair(line.path, line.status),
                     shape.tail))


def _pair(path: str | None, status: int | None) -> bytes:
    """The path's and status's attribute fields, encoded and remembered."""
    if len(_pairs) >= _PAIRS_MAX:
        _pairs.clear()
    encoded = _pairs[path, status] = (otlp.attribute(b"\x4a", "url.path", path) +
                                      otlp.attribute(b"\x4a", "http.response.status_code",
                                                     status))
    return encoded


def log_record(shape: Shape, raw: bytes, end: int, trace: bytes, own: bytes) -> bytes:
    """The line's LogRecord: its body the line's JSON text `raw`, in the span's trace
    (`trace`, `own`: empty when it has none)."""
    time = _TIME(end & _MASK64)
    body = otlp.field(b"\x0a", raw)
    return b"".join((b"\x09", time, shape.severity, b"\x2a", otlp.varint(len(body)), body,
                     shape.log_attrs, b"\x4a\x10" + trace if trace else b"",
                     b"\x52\x08" + own if own else b"", b"\x59", time, _EVENT))
