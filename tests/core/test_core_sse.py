"""The event-stream reader (gateway/core/sse.py), table-driven against the WHATWG rules:
each stream is fed whole and cut at every byte, and must give the same events."""

from __future__ import annotations

import pytest

from gateway.core.sse import Comment, Event, EventStream, SseError, frame, split_lines


def _read(stream: bytes, step: int = 0) -> tuple[list[Event | Comment], bool]:
    parser = EventStream(1 << 20)
    if step == 0:
        out = parser.feed(stream)
    else:
        out = [item for i in range(0, len(stream), step) for item in
               parser.feed(stream[i:i + step])]
    return out, parser.end()


def _events(stream: bytes, step: int = 0) -> list[tuple[str, str | None, str | None]]:
    return [(e.kind, e.text, e.id) for e in _read(stream, step)[0] if isinstance(e, Event)
            and e.data is not None]


# (case, stream, the dispatched events as (type, data, id))
STREAMS: list[tuple[str, bytes, list[tuple[str, str | None, str | None]]]] = [
    ("LF", b"data: a\n\ndata: b\n\n", [("message", "a", None), ("message", "b", None)]),
    ("CRLF", b"data: a\r\n\r\ndata: b\r\n\r\n",
     [("message", "a", None), ("message", "b", None)]),
    ("CR", b"data: a\r\rdata: b\r\r", [("message", "a", None), ("message", "b", None)]),
    # LF then CR: a line end, then an empty line (a CR alone): the event ends there.
    ("LF CR ends an event", b"data: a\n\rdata: b\n\r",
     [("message", "a", None), ("message", "b", None)]),
    ("mixed ends", b"data: a\r\n\ndata: b\n\r\ndata: c\r\r",
     [("message", "a", None), ("message", "b", None), ("message", "c", None)]),
    ("multi-line data", b"data: a\ndata:b\ndata:  c\n\n", [("message", "a\nb\n c", None)]),
    ("empty data line", b"data\n\n", [("message", "", None)]),
    ("empty data then more", b"data:\ndata: x\n\n", [("message", "\nx", None)]),
    ("an event type", b"event: endpoint\ndata: /m\n\n", [("endpoint", "/m", None)]),
    ("an empty event type is a message", b"event:\ndata: x\n\n", [("message", "x", None)]),
    ("an id", b"id: 7\ndata: x\n\n", [("message", "x", "7")]),
    ("an id with NUL is ignored", b"id: 7\x00\ndata: x\n\n", [("message", "x", None)]),
    ("comments", b": ping\ndata: x\n: more\n\n", [("message", "x", None)]),
    ("no data: nothing dispatched", b"event: x\nid: 3\n\n", []),
    ("unknown fields ignored", b"foo: bar\ndata: x\nDATA: y\n\n", [("message", "x", None)]),
    ("a field without colon", b"data\ndata\n\n", [("message", "\n", None)]),
    ("a BOM first is dropped", b"\xef\xbb\xbfdata: x\n\n", [("message", "x", None)]),
    ("a second BOM is not", b"\xef\xbb\xbf\xef\xbb\xbfdata: x\n\n", []),
    ("the last event without its empty line is not dispatched",
     b"data: a\n\ndata: b\n", [("message", "a", None)]),
    ("U+2028 is no line end", "data: a\u2028data: b\n\n".encode(),
     [("message", "a\u2028data: b", None)]),
    ("VT, FF, NEL are no line ends", b"data: a\x0bb\x0cc\xc2\x85d\n\n",
     [("message", "a\x0bb\x0cc\x85d", None)]),
]


@pytest.mark.parametrize(("case", "stream", "events"), STREAMS, ids=[c[0] for c in STREAMS])
def test_events_by_the_whatwg_rules(case: str, stream: bytes,
                                    events: list[tuple[str, str | None, str | None]]) -> None:
    for step in (0, 1, 2, 3, 5):  # (whole, and cut everywhere: a CRLF split, a BOM split)
        assert _events(stream, step) == events, step


def test_retry_and_comments_in_order() -> None:
    items, pending = _read(b": hi\nretry: 1500\nretry: x\ndata: a\n\n: bye\n\n")
    assert items == [Comment(" hi"), Event(data=["a"], retry=1500), Comment(" bye")]
    assert pending is False


@pytest.mark.parametrize(("stream", "pending"), [
    (b"data: a\n\n", False), (b"data: a\n", True), (b"data: a", True), (b": x\n", False),
    (b"", False), (b"data: a\r", True)])
def test_what_the_end_leaves_pending(stream: bytes, pending: bool) -> None:
    assert _read(stream)[1] is pending


@pytest.mark.parametrize("stream", [b"data: \xff\n\n", b"event: \xc3\n\n", b": \xed\xa0\x80\n"])
def test_a_line_that_is_not_utf8_is_refused(stream: bytes) -> None:
    with pytest.raises(SseError, match="not UTF-8"):
        EventStream(1 << 20).feed(stream)


def test_an_event_over_the_limit_is_refused() -> None:
    parser = EventStream(100)
    parser.feed(b"data: " + b"x" * 50 + b"\n")
    with pytest.raises(SseError, match="over 100 bytes"):
        parser.feed(b"data: " + b"x" * 50)
    assert EventStream(100).feed(b"data: " + b"x" * 50 + b"\n\n" + b"data: " + b"x" * 50
                                 + b"\n\n")  # (each event on its own is within it)


@pytest.mark.parametrize(("data", "after_cr", "lines", "rest", "cr"), [
    (b"a\nb", False, [b"a"], b"b", False),
    (b"a\r", False, [b"a"], b"", True),
    (b"\nb\n", True, [b"b"], b"", False),  # (the LF of a CRLF split across pieces)
    (b"\n\n", True, [b""], b"", False),
    (b"a\r\n\r\n", False, [b"a", b""], b"", False),
    (b"a\n\r", False, [b"a", b""], b"", True),
    (b"abc", False, [], b"abc", False),
])
def test_split_lines(data: bytes, after_cr: bool, lines: list[bytes], rest: bytes,
                     cr: bool) -> None:
    assert split_lines(data, after_cr) == (lines, rest, cr)


def test_frame_writes_lf_only() -> None:
    event = Event(type="endpoint", data=["a", "b"], id="3", retry=10)
    assert frame(event) == b"id: 3\nretry: 10\nevent: endpoint\ndata: a\ndata: b\n\n"
    assert frame(Event(id="")) == b"id\n\n"
    assert frame(Event()) == b""
    items, _ = _read(frame(event))
    assert items == [event]
