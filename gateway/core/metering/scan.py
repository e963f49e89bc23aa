"""Incremental, bounded byte scanners for response bodies (pure, no I/O).

* ``SseScanner``: splits a Server-Sent Events stream into the ``data`` of each event and
  hands the ones that can carry usage to a callback. Its line ends and BOM are the
  WHATWG rules every SSE reader of the gateway shares (``gateway/core/sse.py``:
  ``\\n``, ``\\r\\n`` or ``\\r``, split by ``split_lines``, any chunking; a BOM first is
  dropped); unlike a client, it still reads an event the stream ended without its
  empty line (usage the provider counted). Memory: one partial line, at most ``cap``
  bytes; a longer line keeps only its first and last ``SALVAGE`` bytes (``salvage``).
* ``ArrayScanner``: splits a streamed top-level JSON array (Gemini's
  ``streamGenerateContent`` without ``alt=sse``) into its elements, same bounds.
* ``Capture``: a whole JSON document up to ``cap`` bytes, else its head and tail.
* ``salvage``: the ``usage``/``usageMetadata`` object and the model of a document too
  large to keep, from its head (model) and tail (usage, which providers send last).

Only events/elements that match ``USAGE_HINT`` (a usage object, not ``"usage": null``)
are worth a ``json.loads``: the scanners run per relayed chunk, so they stay cheap.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from gateway.core.sse import BOM, split_lines

__all__ = ["SALVAGE", "USAGE_HINT", "ArrayScanner", "Capture", "SseScanner", "salvage"]

SALVAGE = 64 * 1024
USAGE_HINT = re.compile(rb'"usage(?:Metadata)?"\s*:\s*\{')
_TOKENS = re.compile(rb'["\\{}\[\]]')
_QUOTE, _BACKSLASH = 0x22, 0x5C
_OPEN = frozenset(b"{[")
_MODEL = re.compile(rb'(?<!\\)"(model|modelVersion)"\s*:\s*"([^"\\]{1,200})"')

# A chunk ending in a blank line ends every event in it (nothing is left pending).
_EVENTS_END = (b"\n\n", b"\r\n\r\n", b"\r\r")

# (data, None) for a complete event; (head, tail) for one too long to keep.
Sink = Callable[[bytes, bytes | None], None]


class _Long:
    """The head and rolling tail of a line or element longer than the cap."""

    __slots__ = ("head", "tail")

    def __init__(self, start: bytes) -> None:
        self.head = start[:SALVAGE]
        self.tail = start[-SALVAGE:]

    def add(self, data: bytes) -> None:
        self.tail = (self.tail + data)[-SALVAGE:] if len(data) < SALVAGE else data[-SALVAGE:]


class SseScanner:
    """Feeds the ``data`` of each SSE event that matches ``USAGE_HINT`` to ``sink``."""

    __slots__ = ("_cr", "_data", "_fresh", "_long", "_rest", "cap", "sink")

    def __init__(self, sink: Sink, cap: int) -> None:
        self.sink = sink
        self.cap = cap
        self._rest = b""
        self._data: list[bytes] = []
        self._cr = False  # the last chunk ended in \r: a leading \n is its CRLF's half
        self._long: _Long | None = None
        self._fresh = True  # nothing read yet: a BOM first is dropped

    def feed(self, chunk: bytes) -> None:
        if self._fresh:
            chunk = self._rest + chunk
            if len(chunk) < len(BOM) and BOM.startswith(chunk):
                self._rest = chunk  # (the BOM may still be coming)
                return
            self._fresh, self._rest = False, b""
            chunk = chunk.removeprefix(BOM)
            if not chunk:
                return
        if self._rest or self._data or self._cr or self._long is not None:
            # Mid-event (the last chunk was cut inside one): only that event is split
            # into lines; the whole events after it take the quick path below.
            if self._cr or self._long is not None or chunk.find(b"\r") >= 0:
                self._split(chunk)
                return
            if not self._rest and chunk[:1] == b"\n":  # the blank line ending it
                end = 1
            elif (end := chunk.find(b"\n\n") + 2) < 2:  # the event goes on
                self._split(chunk)
                return
            self._split(chunk[:end])  # (leaves the scanner at an event boundary)
            chunk = chunk[end:]
            if not chunk:
                return
        # At an event boundary (the stream's usual state): whole events are skipped
        # unless they carry usage; only those are split into lines.
        if chunk.endswith(b"\n\n"):  # whole events (a provider's usual chunk)
            hint = USAGE_HINT.search(chunk)
            if hint is None:
                return
            if chunk.find(b"\r") < 0:  # (`find`, not `in`: core/leaks.py `_plain`)
                self._usage_events(chunk, hint)
                return
        elif chunk.find(b"\r") < 0:  # whole events, then the start of the next one
            cut = chunk.rfind(b"\n\n") + 2
            if cut > 1:
                hint = USAGE_HINT.search(chunk, 0, cut)
                if hint is not None:
                    self._usage_events(chunk[:cut], hint)
            self._split(chunk[cut:] if cut > 1 else chunk)
            return
        elif chunk.endswith(_EVENTS_END) and USAGE_HINT.search(chunk) is None:
            return
        self._split(chunk)

    def _usage_events(self, chunk: bytes, hint: re.Match[bytes] | None) -> None:
        """Split the events of `chunk` (whole, LF-ended) that `hint` and the later
        matches fall in."""
        done = -1
        while hint is not None:
            start = chunk.rfind(b"\n\n", 0, hint.start()) + 2  # (-1 + 2: from the start)
            if start < 2:
                start = 0
            end = chunk.find(b"\n\n", hint.end()) + 2
            if start > done:  # (an event with two hints is split once)
                event = chunk[start:end]
                # One data line (the usual event): its value goes straight to the sink.
                if event.startswith(b"data:") and event.find(b"\n") == len(event) - 2 \
                        and len(event) - 7 <= self.cap:
                    self.sink(event[6:-2] if event[5:6] == b" " else event[5:-2], None)
                else:
                    self._split(event)
                done = start
            hint = USAGE_HINT.search(chunk, end)

    def _split(self, chunk: bytes) -> None:
        if self._cr and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._cr = False
        if not chunk:
            return
        if self._long is not None:
            end = _line_end(chunk)
            if end < 0:
                self._long.add(chunk)
                return
            self._long.add(chunk[:end])
            self._end_long()
            chunk = chunk[end:]
            if chunk[:2] == b"\r\n":
                chunk = chunk[2:]
            elif chunk[:1] == b"\r" and len(chunk) == 1:
                self._cr = True
                return
            else:
                chunk = chunk[1:]
            if not chunk:
                return
        lines, rest, self._cr = split_lines(self._rest + chunk if self._rest else chunk)
        self._keep(rest)
        for line in lines:
            self._line(line)

    def _keep(self, rest: bytes) -> None:
        if len(rest) > self.cap:
            self._long = _Long(rest)
            self._rest = b""
        else:
            self._rest = rest

    def _end_long(self) -> None:
        long, self._long = self._long, None
        assert long is not None
        if long.head.startswith(b"data:"):
            self._data = []  # the event's other lines cannot be joined to it: salvage only
            self.sink(long.head, long.tail)

    def _line(self, line: bytes) -> None:
        if not line:
            if self._data:
                data = self._data[0] if len(self._data) == 1 else b"\n".join(self._data)
                self._data = []
                if USAGE_HINT.search(data):
                    self.sink(data, None)
            return
        if line.startswith(b"data:"):
            value = line[5:]
            if value[:1] == b" ":
                value = value[1:]
            if sum(map(len, self._data)) + len(value) <= self.cap:
                self._data.append(value)
            else:  # too long to parse whole (it arrived in one piece): salvage it
                self._data = []
                self.sink(value[:SALVAGE], value[-SALVAGE:])

    def finish(self) -> None:
        """End of body: an event not closed by a blank line is still dispatched."""
        if self._long is not None:
            self._end_long()
        elif self._rest:
            self._line(self._rest)
            self._rest = b""
        self._line(b"")


def _line_end(chunk: bytes) -> int:
    n, r = chunk.find(b"\n"), chunk.find(b"\r")
    if n < 0:
        return r
    return n if r < 0 else min(n, r)


class ArrayScanner:
    """Feeds each element of a streamed top-level JSON array that matches
    ``USAGE_HINT`` to ``sink`` (string- and escape-aware, any chunking)."""

    __slots__ = ("_depth", "_elem", "_in_str", "_long", "_skip", "cap", "sink")

    def __init__(self, sink: Sink, cap: int) -> None:
        self.sink = sink
        self.cap = cap
        self._depth = 0
        self._in_str = False
        self._skip = 0  # bytes of the next chunk already consumed by an escape
        self._elem: list[bytes] | None = None
        self._long: _Long | None = None

    def feed(self, chunk: bytes) -> None:
        skip = self._skip
        start = 0 if self._elem is not None or self._long is not None else -1
        for m in _TOKENS.finditer(chunk):
            p = m.start()
            if p < skip:
                continue
            c = chunk[p]
            if self._in_str:
                if c == _BACKSLASH:
                    skip = p + 2
                elif c == _QUOTE:
                    self._in_str = False
                continue
            if c == _QUOTE:
                self._in_str = True
            elif c in _OPEN:
                self._depth += 1
                if self._depth == 2:
                    self._elem, start = [], p
            else:
                if self._depth == 2 and start >= 0:
                    self._add(chunk[start:p + 1])
                    self._emit()
                    start = -1
                self._depth -= 1
        self._skip = max(0, skip - len(chunk))
        if start >= 0:
            self._add(chunk[start:])

    def _add(self, data: bytes) -> None:
        if self._long is not None:
            self._long.add(data)
            return
        assert self._elem is not None
        self._elem.append(data)
        if sum(map(len, self._elem)) > self.cap:
            self._long = _Long(b"".join(self._elem))
            self._elem = None

    def _emit(self) -> None:
        if self._long is not None:
            long, self._long = self._long, None
            self.sink(long.head, long.tail)
        elif self._elem is not None:
            data = b"".join(self._elem)
            if USAGE_HINT.search(data):
                self.sink(data, None)
        self._elem = None


class Capture:
    """A body kept whole up to ``cap`` bytes; beyond, only its head and tail."""

    __slots__ = ("_long", "_parts", "_size", "cap")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._parts: list[bytes] = []
        self._size = 0
        self._long: _Long | None = None

    def feed(self, chunk: bytes) -> None:
        if self._long is not None:
            self._long.add(chunk)
            return
        self._parts.append(chunk)
        self._size += len(chunk)
        if self._size > self.cap:
            self._long = _Long(b"".join(self._parts))
            self._parts = []

    def result(self) -> tuple[bytes, bytes | None]:
        """(body, None) when kept whole, else (head, tail)."""
        if self._long is not None:
            return self._long.head, self._long.tail
        return b"".join(self._parts), None


def _object_at(data: bytes, start: int) -> bytes | None:
    """The JSON object starting at ``data[start]`` (``{``), or None if it is cut off."""
    depth = 0
    in_str = False
    skip = 0
    for m in _TOKENS.finditer(data, start):
        p = m.start()
        if p < skip:
            continue
        c = data[p]
        if in_str:
            if c == _BACKSLASH:
                skip = p + 2
            elif c == _QUOTE:
                in_str = False
        elif c == _QUOTE:
            in_str = True
        elif c in _OPEN:
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return data[start:p + 1]
    return None


_KEYED_OBJECT = re.compile(rb'(?<!\\)"(usage|usageMetadata)"\s*:\s*\{')


def salvage(head: bytes, tail: bytes) -> dict[str, Any]:
    """What can be read from a document too large to keep: the last ``usage`` /
    ``usageMetadata`` object in its tail and the first ``model`` / ``modelVersion`` in
    its head (else the tail). A key with an unescaped quote before a colon cannot be
    inside a JSON string, so a window that starts mid-string is still read right."""
    doc: dict[str, Any] = {}
    found: dict[str, int] = {}
    for m in _KEYED_OBJECT.finditer(tail):
        found[m.group(1).decode()] = m.end() - 1
    for key, at in found.items():
        raw = _object_at(tail, at)
        if raw is None:
            continue
        try:
            value = json.loads(raw)
        except ValueError:
            continue
        doc[key] = value
    for window in (head, tail):
        for m in _MODEL.finditer(window):
            doc.setdefault(m.group(1).decode(), m.group(2).decode("utf-8", "replace"))
        if "model" in doc or "modelVersion" in doc:
            break
    return doc
