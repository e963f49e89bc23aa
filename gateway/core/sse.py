"""Server-Sent Events read by the WHATWG rules (HTML, "Parsing an event stream"), and
written back in one canonical form (pure, no I/O).

The rules every reader of a stream must share, or a server can make the gateway read
one thing and a client another:

* A line ends at CRLF, LF or a lone CR: `\\n\\r` is a line end then an empty line, which
  ends the event. A CR at the end of a chunk waits for the next byte (the LF of a
  CRLF split across chunks is no second line end). `split_lines` is the one splitter
  (metering's `SseScanner` uses it too).
* One U+FEFF (a UTF-8 BOM) at the very start of the stream is dropped.
* An empty line dispatches the event: its `data` lines joined by LF (none: nothing is
  dispatched), its `event` type (else "message"), `id` (a value with NUL is ignored),
  `retry` (ASCII digits only, else ignored). A line starting with `:` is a comment; a
  line without `:` is a field with an empty value; one space after the colon is
  dropped; unknown fields are ignored.
* At the end of the stream an event without its empty line is not dispatched.

`EventStream` parses strictly where the rules let clients differ: a line that is not
UTF-8 (one client replaces, another drops) and a pending event over the size limit
raise `SseError`. `frame` writes an event back with LF line ends only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BOM", "Comment", "Event", "EventStream", "SseError", "frame", "split_lines"]

BOM = b"\xef\xbb\xbf"
_CR = 0x0D


def split_lines(data: bytes, after_cr: bool = False) -> tuple[list[bytes], bytes, bool]:
    """The complete lines of `data` (without their ends), the partial line after them,
    and whether the last line ended in a CR that was the last byte (its LF may come in
    the next piece: pass `after_cr=True` with it). Line ends: CRLF, LF, CR."""
    if after_cr and data[:1] == b"\n":
        data = data[1:]
    last = max(data.rfind(b"\n"), data.rfind(b"\r"))
    if last < 0:
        return [], data, False
    return data[:last + 1].splitlines(), data[last + 1:], \
        last == len(data) - 1 and data[last] == _CR


class SseError(ValueError):
    """The stream cannot be read one way only; the message says why (no bytes)."""


@dataclass(slots=True)
class Event:
    """What one empty line ends: the fields the block between two empty lines set.
    `data` None: no data line (a client dispatches nothing, but `id` and `retry` still
    take effect)."""

    type: str | None = None
    data: list[str] | None = None
    id: str | None = None
    retry: int | None = None

    @property
    def kind(self) -> str:
        """The event type a client dispatches it as."""
        return self.type or "message"

    @property
    def text(self) -> str | None:
        """The data a client dispatches (lines joined by LF), or None."""
        return None if self.data is None else "\n".join(self.data)


@dataclass(frozen=True, slots=True)
class Comment:
    """A comment line (a keep-alive, most often)."""

    text: str


@dataclass(slots=True)
class EventStream:
    """Feeds bytes, returns what they complete: events (at each empty line) and
    comments, in stream order. `limit`: the most bytes one pending event may hold.
    Raises SseError."""

    limit: int
    _rest: bytes = b""
    _cr: bool = False
    _started: bool = False
    _event: Event = field(default_factory=Event)
    _size: int = 0
    _open: bool = False  # a field line was read since the last empty line

    def feed(self, chunk: bytes) -> list[Event | Comment]:
        if not self._started:
            head = self._rest + chunk
            if len(head) < len(BOM) and BOM.startswith(head):
                self._rest = head  # (the BOM may still be coming)
                return []
            self._started, self._rest = True, b""
            chunk = head.removeprefix(BOM)
        lines, rest, self._cr = split_lines(self._rest + chunk if self._rest else chunk,
                                            self._cr)
        self._rest = rest
        out: list[Event | Comment] = []
        for line in lines:
            self._line(line, out)
        if self._size + len(self._rest) > self.limit:
            raise SseError(f"an event over {self.limit} bytes")
        return out

    def end(self) -> bool:
        """The stream ended: True if an event was left without its empty line (not
        dispatched, as a client does not dispatch it)."""
        pending = self._open or bool(self._rest)
        self._rest, self._open, self._event, self._size = b"", False, Event(), 0
        return pending

    def _line(self, raw: bytes, out: list[Event | Comment]) -> None:
        if not raw:
            if self._open:
                out.append(self._event)
            self._event, self._size, self._open = Event(), 0, False
            return
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise SseError("a line that is not UTF-8") from None
        if line[0] == ":":
            out.append(Comment(line[1:]))
            return
        name, colon, value = line.partition(":")
        if colon and value[:1] == " ":
            value = value[1:]
        self._size += len(raw)
        self._open = True
        event = self._event
        if name == "data":
            if event.data is None:
                event.data = []
            event.data.append(value)
        elif name == "event":
            event.type = value
        elif name == "id" and "\0" not in value:
            event.id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            event.retry = int(value)


def frame(event: Event) -> bytes:
    """`event` written back: `id`, `retry`, `event` and `data` lines as read, LF line
    ends, an empty line after (b"" for an event that sets nothing). The caller keeps
    line ends out of the values (a parsed event has none)."""
    lines = []
    if event.id is not None:
        lines.append(f"id: {event.id}" if event.id else "id")
    if event.retry is not None:
        lines.append(f"retry: {event.retry}")
    if event.type is not None:
        lines.append(f"event: {event.type}")
    for data in event.data or ():
        lines.append(f"data: {data}")
    if not lines:
        return b""
    return ("\n".join(lines) + "\n\n").encode()
