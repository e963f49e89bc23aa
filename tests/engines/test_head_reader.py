"""The head reader is h11's parser: every head it reads, h11 reads the same way, and every
head h11 refuses, it refuses. A differential test against h11's own readers
(`h11._readers`, the reference, reached here only) on hand-picked and generated heads."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import h11
import pytest

from gateway.engines import patches
from gateway.engines.patches import RawRequest, RawResponse, ReceiveBuffer

REFERENCE = __import__("h11._readers", fromlist=["_"])


def _run(reader: Callable[[ReceiveBuffer], Any], data: bytes) -> tuple[str, Any, bytes]:
    buf = ReceiveBuffer()
    buf += data
    try:
        event = reader(buf)
    except h11.LocalProtocolError as exc:
        return "refused", str(exc), bytes(buf)
    return "read", event, bytes(buf)


def _ours(data: bytes, request: bool) -> tuple[str, Any, bytes]:
    return _run(patches.read_request_head if request else patches.read_response_head, data)


def _theirs(data: bytes, request: bool) -> tuple[str, Any, bytes]:
    kind, event, rest = _run(REFERENCE.maybe_read_from_IDLE_client if request
                             else REFERENCE.maybe_read_from_SEND_RESPONSE_server, data)
    if kind != "read" or event is None:
        return kind, event, rest
    fields = event.headers.raw_items()
    if request:
        return kind, RawRequest(event.method, event.target, event.http_version, fields), rest
    return kind, RawResponse(event.status_code, event.reason, event.http_version, fields), rest


def _same(data: bytes, request: bool) -> tuple[str, Any, bytes]:
    ours, theirs = _ours(data, request), _theirs(data, request)
    assert ours == theirs, data
    return ours


REQUESTS = [
    b"GET / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET http://a.test/x?y=1 HTTP/1.1\r\nHost: a.test\r\nX-Api-Key:  k  \r\n\r\nrest",
    b"POST /v1 HTTP/1.1\r\nHost: a\r\nContent-Length: 12\r\n\r\n",
    b"POST /v1 HTTP/1.1\r\nHost: a\r\nContent-Length: 007\r\n\r\n",
    b"POST /v1 HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 5\r\n\r\n",   # h11: one 5
    b"POST /v1 HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-length: 5\r\n\r\n",
    b"POST /v1 HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
    b"POST /v1 HTTP/1.1\r\nHost: a\r\nContent-Length: 123456789012345678901\r\n\r\n",
    b"POST /v1 HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1 HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: Chunked\r\n\r\n",  # lower-cased
    b"POST /v1 HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
    b"POST /v1 HTTP/1.1\r\nHost: a\r\nX: transfer-encoding:\r\n\r\n",
    b"GET / HTTP/1.1\r\n\r\n",                            # no Host on 1.1
    b"GET / HTTP/1.0\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nhost: b\r\n\r\n",     # two Hosts
    b"GET / HTTP/1.1\r\nHost : a\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n",     # obsolete line folding
    b"GET / HTTP/1.1\r\n folded\r\nHost: a\r\n\r\n",
    b"GET / HTTP/1.1\nHost: a\n\n",                       # bare LF line ends
    b"GET / HTTP/1.1\r\nHost: a\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nX: a\x00b\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nX: a\rb\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nX: a\x0bb\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nX: \xff\x80 \t\xfe\r\n\r\n",  # obs-text
    b"GET / HTTP/1.1\r\nHost: a\r\nX:\r\n\r\n",           # empty value
    b"GET / HTTP/1.1\r\nHost: a\r\nX: \t \r\n\r\n",
    b"GET /a b HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET / HTTP/2.0\r\nHost: a\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\n",                     # incomplete
    b"\x16\x03\x01\x00",                                  # TLS where HTTP was expected
    b"\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"G@T / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"CONNECT a.test:443 HTTP/1.1\r\nHost: a.test:443\r\nProxy-Authorization: Basic eA==\r\n\r\n",
]

RESPONSES = [
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
    b"HTTP/1.1 200\r\nContent-Length: 5\r\n\r\n",
    b"HTTP/1.1 200 \r\n\r\n",
    b"HTTP/1.1 204 No Content\r\n\r\n",
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\nrest",
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
    b"HTTP/1.1 2000 OK\r\n\r\n",
    b"HTTP/1.1 099 Odd\r\n\r\n",                         # (h11: read, then refused)
    b"HTTP/1.1 000\r\n\r\n",
    b"HTTP/1.1 999 Odd\r\n\r\n",
    b"HTTP/1.0 200 a reason\twith tab \xff\r\nX: y\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nHost: a\r\nHost: b\r\n\r\n",      # (no Host rule for responses)
    b"HTTP/1.1 200 OK\r\nX: y\r\n z\r\n\r\n",
    b"HTTP/1.1 200 OK\nX: y\n\n",
    b"HTTP/1.1 200 OK\r\n",
]


@pytest.mark.parametrize("data", REQUESTS)
def test_request_heads_read_as_h11_reads_them(data: bytes) -> None:
    _same(data, request=True)


@pytest.mark.parametrize("data", RESPONSES)
def test_response_heads_read_as_h11_reads_them(data: bytes) -> None:
    _same(data, request=False)


def test_the_common_heads_take_the_one_pass() -> None:
    """The usual request and response read without h11's per-line reader (the point of
    the one pass), and a folded head still with it."""
    calls: list[int] = []
    original = REFERENCE.maybe_read_from_IDLE_client

    def counting(buf: ReceiveBuffer) -> Any:
        calls.append(1)
        return original(buf)

    patches.maybe_read_from_IDLE_client = counting  # type: ignore[attr-defined]
    try:
        assert _ours(REQUESTS[1], True)[0] == "read"
        assert _ours(REQUESTS[2], True)[0] == "read"
        assert not calls
        assert _ours(REQUESTS[16], True)[0] == "refused" or calls
        assert calls
    finally:
        patches.maybe_read_from_IDLE_client = original  # type: ignore[attr-defined]


_NAMES = [b"Host", b"host", b"HOST", b"Content-Length", b"content-length", b"Transfer-Encoding",
          b"X-Api-Key", b"Connection", b"Upgrade", b"A", b"x-y!#$%&'*+.^_`|~", b"Bad Name",
          b"", b"Na\x00me", b"N\xffe"]
_VALUES = [b"a", b"5", b"007", b"5, 5", b"5,6", b"chunked", b"Chunked", b"gzip", b"", b" ",
           b"a b", b"a\tb", b"a  ", b"\ta", b"\xff\x80", b"a\x00b", b"a\rb", b"a\x7fb",
           b"close", b"keep-alive, Upgrade", b"websocket", b"12345678901234567890",
           b"123456789012345678901", b"-3", b"\x0cq", b"a\x1cb", b"\x85", b"\xa0", b"a\x0bb",
           b"a\x1f"]
_STARTS = [b"GET / HTTP/1.1", b"POST /v1/chat HTTP/1.1", b"GET http://a/ HTTP/1.0",
           b"CONNECT a:443 HTTP/1.1", b"GET  / HTTP/1.1", b"GET / HTTP/1.1 ", b"get /\x7f HTTP/1.1",
           b"GET / HTTP/3.0"]
_STATUS = [b"HTTP/1.1 200 OK", b"HTTP/1.1 101 Switching", b"HTTP/1.0 404", b"HTTP/1.1 100 ",
           b"HTTP/1.1 20 OK", b"HTTP/1.1 200 O\x00K", b"HTTP/1.1 199 x", b"HTTP/1.1 099 x",
           b"HTTP/1.1 000", b"HTTP/1.1 999 x"]
_ENDS = [b"\r\n", b"\r\n", b"\r\n", b"\n", b"\r\n "]


def _generated(rng: random.Random, starts: list[bytes]) -> bytes:
    """A head from the pieces above; half of them from the pieces h11 takes (so the
    generated heads are read, not only refused), with the fields h11 rewrites or
    refuses (several Hosts or lengths, Transfer-Encoding) still among them."""
    tame = rng.random() < 0.5
    lines = [rng.choice(starts[:3] if tame else starts)]
    if tame and rng.random() < 0.7:
        lines.append(b"Host: a")
    for _ in range(rng.randrange(0, 7)):
        lines.append(rng.choice(_NAMES[:11] if tame else _NAMES) +
                     rng.choice([b":", b": ", b":\t"] if tame else [b":", b": ", b" :"]) +
                     rng.choice(_VALUES[:14] if tame else _VALUES) + rng.choice([b"", b" ", b"\t"]))
    ends = _ENDS[:3] if tame else _ENDS
    data = b"".join(line + rng.choice(ends) for line in lines)
    data += b"\r\n" if tame else rng.choice([b"\r\n", b"\n", b""])
    return data + rng.choice([b"", b"body", b"\r\n"])


@pytest.mark.parametrize("request_side", [True, False])
def test_generated_heads_read_as_h11_reads_them(request_side: bool) -> None:
    rng = random.Random(22 + request_side)
    read = 0
    for _ in range(6000):
        data = _generated(rng, _STARTS if request_side else _STATUS)
        kind, event, _ = _same(data, request_side)
        read += kind == "read" and event is not None
    assert read > 800  # (the generator makes valid heads too, not only refusals)


def test_a_long_malformed_head_is_refused_in_linear_time() -> None:
    """Backtracking cannot blow up on a large head that fails at its end."""
    line = b"X-Long: " + b"a " * 4000 + b"a\r\n"
    data = b"GET / HTTP/1.1\r\nHost: a\r\n" + line * 7 + b"X: \x00\r\n\r\n"
    started = time.perf_counter()
    for _ in range(20):
        assert _same(data, True)[0] == "refused"
    assert time.perf_counter() - started < 2.0
