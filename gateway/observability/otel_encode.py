"""OTLP spans and log records encoded straight to protobuf bytes, in the exporter process:
the few fields the export sets, written by hand (no message objects, no SDK objects,
whose building and encoding cost the exporter most of its CPU per audit line:
docs/observability.md, "Cost").

The wire format is protobuf's (varints, fixed64, length-delimited fields) with the field
numbers of opentelemetry-proto's messages (trace/v1 Span and Status, logs/v1 LogRecord,
common/v1 KeyValue, AnyValue and InstrumentationScope, resource/v1 Resource, and the
collector services' export requests); tests/observability/test_otel_encode.py reads
every message back with those classes. Fields at their default (empty, zero) are left
out, as protobuf leaves them. An attribute (key and value) seen before is reused as
encoded: most of a line's attributes (decision, policy, rule, host, engine…) repeat
from line to line. A batch's resource and scope are encoded once per batch.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "CLIENT",
    "SAMPLED",
    "SERVER",
    "Parent",
    "attribute",
    "attributes",
    "field",
    "log_record",
    "logs_request",
    "parent_of",
    "resource",
    "severity",
    "span",
    "span_id",
    "status",
    "trace_id",
    "traces_request",
    "varint",
]

SERVER = 2  # Span.SpanKind SPAN_KIND_SERVER
CLIENT = 3  # SPAN_KIND_CLIENT
_STATUS_ERROR = 2  # Status.StatusCode STATUS_CODE_ERROR
_INFO, _WARN = 9, 13  # SeverityNumber SEVERITY_NUMBER_INFO, SEVERITY_NUMBER_WARN
# (trace id, parent span id, flags) of a sandbox's traceparent
Parent = tuple[bytes, bytes, int]

_MASK64 = (1 << 64) - 1
_SCALARS = frozenset((str, int, float, bool))
_CACHE_MAX = 8192  # encoded attributes remembered (cleared when full)
_cache: dict[tuple[bytes, str, Any, type], bytes] = {}
_fixed64 = struct.Struct("<Q").pack
_double = struct.Struct("<d").pack
SAMPLED = b"\x85\x01" + struct.pack("<I", 0x100)  # Span.flags (16, fixed32): sampled


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_VARINTS = [_varint(n) for n in range(1 << 14)]  # (the lengths of most fields: one index)


def varint(n: int) -> bytes:
    """A varint's bytes (n >= 0)."""
    return _VARINTS[n] if n < 16384 else _varint(n)


_KINDS = {kind: b"\x30" + bytes((kind,)) for kind in range(6)}  # Span.kind (6, varint)


def field(tag: bytes, data: bytes) -> bytes:
    """A length-delimited field: its tag, the length, the bytes."""
    size = len(data)
    return tag + (_VARINTS[size] if size < 16384 else _varint(size)) + data


_field = field


def _any(value: Any) -> bytes:
    """An AnyValue's bytes."""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value & _MASK64)
    if isinstance(value, float):
        return b"\x21" + _double(value)
    text = value if isinstance(value, str) else str(value)
    return _field(b"\x0a", text.encode("utf-8", "surrogatepass"))


def _attribute(tag: bytes, key: str, value: Any) -> bytes:
    """A KeyValue field numbered by `tag`, encoded and remembered."""
    encoded = _field(tag, _field(b"\x0a", key.encode()) + _field(b"\x12", _any(value)))
    if len(_cache) >= _CACHE_MAX:
        _cache.clear()
    _cache[(tag, key, value, value.__class__)] = encoded
    return encoded


def attribute(tag: bytes, key: str, value: Any) -> bytes:
    """One KeyValue field numbered by `tag` (empty for a None value), as `attributes`."""
    if value is None:
        return b""
    if value.__class__ not in _SCALARS:
        value = str(value)
    return _cache.get((tag, key, value, value.__class__)) or _attribute(tag, key, value)


def attributes(attrs: Mapping[str, Any], tag: bytes = b"\x0a") -> bytes:
    """Repeated KeyValue fields numbered by `tag` (a None value is left out)."""
    out = []
    get = _cache.get
    for key, value in attrs.items():
        if value is not None:
            if value.__class__ not in _SCALARS:  # (a list, a dict, an enum: its text)
                value = str(value)
            out.append(get((tag, key, value, value.__class__)) or
                       _attribute(tag, key, value))
    return b"".join(out)


def resource(attrs: Mapping[str, Any]) -> bytes:
    """A Resource's bytes."""
    return attributes(attrs)


def parent_of(trace_header: str | None) -> Parent | None:
    """The sandbox's span (`trace`: a traceparent the core checked), or None."""
    if not trace_header:
        return None
    parts = trace_header.split("-")
    try:
        return (bytes.fromhex(parts[1]), bytes.fromhex(parts[2]), int(parts[3][:2], 16) & 1)
    except (IndexError, ValueError):
        return None


def span_id() -> bytes:
    """A random span id, never all zero (as the SDK's id generator makes them: an id,
    not a secret)."""
    return (random.getrandbits(64) or 1).to_bytes(8)


def trace_id() -> bytes:
    """A random trace id, never all zero (as the SDK's id generator makes them)."""
    return (random.getrandbits(128) or 1).to_bytes(16)


def span(name: str, kind: int, trace: bytes, own_id: bytes, parent_id: bytes,
         start: int, end: int, attrs: Mapping[str, Any], error: str | None = None) -> bytes:
    """One Span's bytes; `error`: its status is ERROR with that message."""
    parts = [_field(b"\x0a", trace), _field(b"\x12", own_id)]
    if parent_id:
        parts.append(_field(b"\x22", parent_id))
    parts += [_field(b"\x2a", name.encode("utf-8", "surrogatepass")), _KINDS[kind],
              b"\x39", _fixed64(start & _MASK64), b"\x41", _fixed64(end & _MASK64),
              attributes(attrs, b"\x4a")]
    if error is not None:
        parts.append(status(error))
    parts.append(SAMPLED)
    return b"".join(parts)


def status(error: str) -> bytes:
    """A Span's status field (15): ERROR, with `error` as its message."""
    return _field(b"\x7a", _field(b"\x12", error.encode("utf-8", "surrogatepass")) +
                  b"\x18" + _varint(_STATUS_ERROR))


def severity(warn: bool) -> bytes:
    """A LogRecord's severity number (2) and text (3): WARN or INFO."""
    return b"\x10" + _varint(_WARN) + b"\x1a\x04WARN" if warn else \
        b"\x10" + _varint(_INFO) + b"\x1a\x04INFO"


def log_record(body: bytes | str, end: int, attrs: Mapping[str, Any], warn: bool,
               trace: bytes = b"", own_id: bytes = b"",
               event: str = "sandbox_gateway.audit") -> bytes:
    """One LogRecord's bytes; `body` (a string value): the audit line's JSON text."""
    text = body if isinstance(body, bytes) else body.encode("utf-8", "surrogatepass")
    time = _fixed64(end & _MASK64)
    parts = [b"\x09", time, severity(warn), _field(b"\x2a", _field(b"\x0a", text)),
             attributes(attrs, b"\x32")]
    if trace:
        parts.append(_field(b"\x4a", trace))
    if own_id:
        parts.append(_field(b"\x52", own_id))
    parts += [b"\x59", time, _field(b"\x62", event.encode())]
    return b"".join(parts)


def _request(res: bytes, scope: str, items: Iterable[bytes]) -> bytes:
    """ExportTrace/LogsServiceRequest: one resource, one scope, its items (the field
    numbers of spans and log records in their scope are the same: 2), in one join (the
    lengths added up first, so that no item is copied twice)."""
    items = list(items)
    heads = [b"\x12" + varint(len(item)) for item in items]
    parts: list[bytes] = [b""] * (2 * len(items))
    parts[::2] = heads
    parts[1::2] = items
    scoped = _field(b"\x0a", _field(b"\x0a", scope.encode()))
    block = len(scoped) + sum(map(len, heads)) + sum(map(len, items))
    resourced = _field(b"\x0a", res)
    size = len(resourced) + 1 + len(varint(block)) + block
    return b"".join([b"\x0a", varint(size), resourced, b"\x12", varint(block), scoped,
                     *parts])


def traces_request(res: bytes, scope: str, spans: Iterable[bytes]) -> bytes:
    return _request(res, scope, spans)


def logs_request(res: bytes, scope: str, records: Iterable[bytes]) -> bytes:
    return _request(res, scope, records)
