"""HTTP/1 framing: strict heads, smuggling shapes, body lengths, hop-by-hop fields."""

from __future__ import annotations

import random

import h11
import pytest
from h11._readers import ContentLengthReader as H11Reader

from gateway.core.messages import Headers, RequestHead, ResponseHead
from gateway.core.refusal import Refusal
from gateway.core.target import request_target
from gateway.engines.h1 import framing
from gateway.engines.patches import (
    ContentLengthReader,
    ReceiveBuffer,
    read_request_head,
    read_response_head,
)


def parse(raw: bytes) -> RequestHead:
    buf = ReceiveBuffer()
    buf += raw
    event = read_request_head(buf)
    assert event is not None
    return framing.request_head(event)


@pytest.mark.parametrize(("raw", "size"), [
    (b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", 0),
    (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 12\r\n\r\n", 12),
    (b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n", None),
    (b"GET / HTTP/1.0\r\n\r\n", 0),
])
def test_request_sizes(raw: bytes, size: int | None) -> None:
    assert framing.request_body_size(parse(raw)) == size


@pytest.mark.parametrize(("raw", "words"), [
    (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n",
     "smuggling"),
    (b"GET / HTTP/9.9\r\nHost: a\r\n\r\n", "not supported"),
])
def test_refused_heads(raw: bytes, words: str) -> None:
    with pytest.raises(framing.ProtocolError, match=words):
        parse(raw)


@pytest.mark.parametrize("raw", [
    b"GET / HTTP/1.1\r\nHost: a\r\nX: a\x00b\r\n\r\n",       # NUL in a value
    b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",          # two Hosts
    b"GET / HTTP/1.1\r\n\r\n",                                 # no Host on 1.1
    b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
    b"GET /a b HTTP/1.1\r\nHost: a\r\n\r\n",
])
def test_h11_refuses(raw: bytes) -> None:
    buf = ReceiveBuffer()
    buf += raw
    with pytest.raises(h11.ProtocolError):
        read_request_head(buf)


@pytest.mark.parametrize(("method", "status", "fields", "size"), [
    ("GET", 200, [("Content-Length", "5")], 5),
    ("HEAD", 200, [("Content-Length", "5")], 0),
    ("GET", 204, [], 0),
    ("GET", 304, [("Content-Length", "9")], 0),
    ("GET", 200, [("Transfer-Encoding", "chunked")], None),
    ("GET", 200, [], -1),
])
def test_response_sizes(method: str, status: int, fields: list[tuple[str, str]],
                        size: int | None) -> None:
    head = ResponseHead(status, "X", Headers.of(*fields))
    assert framing.response_body_size(method, head) == size


def test_response_head_and_101() -> None:
    buf = ReceiveBuffer()
    buf += b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\nrest"
    event = read_response_head(buf)
    assert event is not None and event.status_code == 101 and bytes(buf) == b"rest"


def test_hop_by_hop_fields_are_not_forwarded() -> None:
    head = RequestHead("GET", "/x", Headers.of(
        ("Host", "a"), ("Connection", "keep-alive, X-Secret-Hop"), ("X-Secret-Hop", "1"),
        ("Keep-Alive", "timeout=5"), ("Proxy-Connection", "keep-alive"), ("TE", "trailers"),
        ("Content-Length", "3"), ("Accept", "*/*")))
    wire = framing.serialize_request(head, 3, upgrade=False)
    assert wire == (b"GET /x HTTP/1.1\r\nHost: a\r\nAccept: */*\r\nContent-Length: 3\r\n\r\n")


def test_websocket_upgrade_is_kept() -> None:
    head = RequestHead("GET", "/ws", Headers.of(("Host", "a"), ("Upgrade", "websocket"),
                                                ("Connection", "Upgrade")))
    wire = framing.serialize_request(head, 0, upgrade=True)
    assert b"Upgrade: websocket\r\n" in wire and b"Connection: Upgrade\r\n" in wire


def test_response_framing_choices() -> None:
    head = ResponseHead(200, "OK", Headers.of(("Content-Length", "3"), ("X", "y")))
    assert framing.serialize_response(head, chunked=True, length=None, close=False) == (
        b"HTTP/1.1 200 OK\r\nX: y\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert framing.serialize_response(head, chunked=False, length=3, close=True) == (
        b"HTTP/1.1 200 OK\r\nX: y\r\nConnection: close\r\nContent-Length: 3\r\n\r\n")


# Every field name the core's own check refuses (target.request_target: names are
# tokens), h11 refuses first: so a head h11 parsed is marked `names_checked` and the core
# checks only its values (h11 lets some control characters through in values).
@pytest.mark.parametrize("field", [
    b"X N: v", b"X\x00N: v", b"X(N): v", b"X-N : v", b": v", b"X-\xffN: v", b"X/N: v",
])
def test_h11_refuses_every_field_name_the_core_would(field: bytes) -> None:
    name, _, value = field.partition(b":")
    head = RequestHead("GET", "/", Headers([(name, value.strip())]))
    if name:
        with pytest.raises(Refusal):
            request_target(head, ("a.test", 443), tls=True)
    with pytest.raises(h11.ProtocolError):
        parse(b"GET / HTTP/1.1\r\nHost: a\r\n" + field + b"\r\n\r\n")


@pytest.mark.parametrize("value", [b"a\x01b", b"a\x7fb", b"a\x1bb"])
def test_the_core_checks_values_h11_lets_through(value: bytes) -> None:
    head = parse(b"GET / HTTP/1.1\r\nHost: a\r\nX-N: " + value + b"\r\n\r\n")
    assert head.names_checked
    with pytest.raises(Refusal, match="control characters"):
        request_target(head, ("a.test", 443), tls=True)


def _read_all(reader_type: type, length: int, pieces: list[bytes]
              ) -> tuple[list[bytes], bytes, list[str]]:
    """Feed `pieces` one at a time to a Content-Length reader; (the data events, what
    follows the body: left in the buffer and not fed yet, the event kinds)."""
    reader = reader_type(length)
    buf = ReceiveBuffer()
    data: list[bytes] = []
    kinds: list[str] = []
    for i, piece in enumerate(pieces):
        buf += piece
        while (event := reader(buf)) is not None:
            kinds.append(type(event).__name__)
            if isinstance(event, h11.EndOfMessage):
                return data, bytes(buf) + b"".join(pieces[i + 1:]), kinds
            data.append(bytes(event.data))
    return data, bytes(buf), kinds


@pytest.mark.parametrize("seed", range(40))
def test_the_content_length_reader_reads_as_h11s(seed: int) -> None:
    """The one-copy Content-Length reader (patches.ContentLengthReader) gives h11's
    events for the same bytes, cut anywhere, with the next message left in the buffer."""
    rng = random.Random(seed)
    length = rng.choice([0, 1, 7, 1000, 65536, 300_000])
    body = rng.randbytes(length) + b"HTTP/1.1 200 OK\r\n\r\n"[:rng.randrange(20)]
    cuts = sorted(rng.sample(range(1, len(body)), min(len(body) - 1, rng.randrange(6))))
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    ours = _read_all(ContentLengthReader, length, pieces)
    assert ours == _read_all(H11Reader, length, pieces)
    assert b"".join(ours[0]) == body[:length] and ours[1] == body[length:]
    assert all(type(d) is bytes for d in ours[0])
