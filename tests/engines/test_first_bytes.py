"""What a connection's first bytes are (`classify`, read by the doors for the gate), on
real ClientHellos from Python's TLS stack and on HTTP heads (pure, table-driven). How the
doors act on the answer: the parity and transparent-mode suites, on a real gateway."""

from __future__ import annotations

import random
import ssl
from collections.abc import Sequence

import pytest

from gateway.engines import patches
from gateway.engines.first_bytes import MAX_FIRST, FirstBytes, classify


def client_hello(server_name: str | None, alpn: list[str] | None = None) -> bytes:
    """The ClientHello a real TLS client sends first."""
    context = ssl.create_default_context()
    if server_name is None:
        context.check_hostname = False
    if alpn is not None:
        context.set_alpn_protocols(alpn)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


HELLO = client_hello("api.example.test", ["h2", "http/1.1"])

TLS = [
    (HELLO, FirstBytes("tls", "api.example.test", (b"h2", b"http/1.1"))),
    (client_hello("api.example.test", ["h2"]), FirstBytes("tls", "api.example.test", (b"h2",))),
    (client_hello("API.Example.TEST"), FirstBytes("tls", "API.Example.TEST", ())),  # as sent
    (client_hello("10.0.0.1"), FirstBytes("tls", None, ())),  # no SNI for an address
    (client_hello(None), FirstBytes("tls", None, ())),
    (HELLO[:9] + b"\xff" * (len(HELLO) - 9), FirstBytes("tls")),  # a broken ClientHello
    (b"\x16\x03\x01" + b"\x00" * 10, FirstBytes("tls")),
    (HELLO[:5] + b"\x00" * MAX_FIRST, FirstBytes("tls")),  # never complete: no name
]


@pytest.mark.parametrize(("data", "first"), TLS)
def test_tls_gives_its_server_name_and_alpn(data: bytes, first: FirstBytes) -> None:
    assert classify(data) == first
    assert classify(data, http=False) == first


@pytest.mark.parametrize("cut", [0, 2, 3, 5, 50, len(HELLO) - 1])
def test_a_partial_client_hello_needs_more(cut: int) -> None:
    assert classify(HELLO[:cut]) is None


HTTP = [
    (b"GET / HTTP/1.1\r\nHost: a.example.test\r\n\r\n", FirstBytes("http", "a.example.test")),
    (b"get / HTTP/1.1\r\nhost: A.test:8080\r\n\r\n", FirstBytes("http", "A.test:8080")),
    (b"POST /x HTTP/1.1\r\nContent-Length: 5\r\nHost: b.test\r\n\r\nhello",
     FirstBytes("http", "b.test")),
    (b"GET / HTTP/1.0\r\n\r\n", FirstBytes("http")),  # HTTP/1.0 without Host: no name
    (b"GET / HTTP/1.1\r\n\r\n", FirstBytes("http")),  # a head the engine refuses
    (b"GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n", FirstBytes("http")),
    (b"GET / HTTP/1.1\r\nbad header\r\n\r\n", FirstBytes("http")),
    (b"GET /" + b"a" * MAX_FIRST, FirstBytes("http")),  # no end of head within the bound
]


@pytest.mark.parametrize(("data", "first"), HTTP)
def test_an_http_head_gives_its_host(data: bytes, first: FirstBytes) -> None:
    assert classify(data) == first


@pytest.mark.parametrize("data", [b"GE", b"GET / HTTP/1.1\r\n",
                                  b"GET / HTTP/1.1\r\nHost: a.test\r\n"])
def test_a_partial_http_head_needs_more(data: bytes) -> None:
    assert classify(data) is None


@pytest.mark.parametrize("data", [
    b"\x00\x01\x02", b"*1\r\n$4\r\nPING\r\n", b"\x80\x01\x00", b"1 GET / HTTP/1.1\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n",  # with http=False (a tunnel's first bytes)
])
def test_anything_else_is_tcp(data: bytes) -> None:
    assert classify(data, http=False) == FirstBytes("tcp")
    if not data[:3].isalpha():
        assert classify(data) == FirstBytes("tcp")


@pytest.mark.parametrize(("first", "http1"), [
    (FirstBytes("tls", "a.test", ()), True),
    (FirstBytes("tls", "a.test", (b"http/1.1",)), True),
    (FirstBytes("tls", "a.test", (b"h2", b"http/1.1")), True),
    (FirstBytes("tls", "a.test", (b"h2",)), False),  # only mitmproxy serves it
    (FirstBytes("tls", "a.test", (b"h3",)), False),
])
def test_the_http1_engine_serves_tls_offering_http11_or_nothing(first: FirstBytes,
                                                                  http1: bool) -> None:
    assert first.http1 is http1


def _mitmproxys(data: bytes) -> tuple[str | None, tuple[bytes, ...]] | str | None:
    """mitmproxy's own reading (`layers.tls.parse_client_hello`, `tls.ClientHello`), or
    the name of the error it raised."""
    from mitmproxy.proxy.layers.tls import parse_client_hello

    try:
        hello = parse_client_hello(data)
    except Exception as exc:  # (compared by type with ours)
        return type(exc).__name__
    return None if hello is None else (hello.sni, tuple(hello.alpn_protocols))


def _ours(data: bytes) -> tuple[str | None, tuple[bytes, ...]] | str | None:
    try:
        return patches.client_hello(data)
    except Exception as exc:
        return type(exc).__name__


def _in_records(hello: bytes, sizes: list[int]) -> bytes:
    """The handshake message of a one-record `hello` cut into records of `sizes`."""
    message, out, at = hello[5:], b"", 0
    for size in [*sizes, len(hello)]:
        piece = message[at:at + size]
        if piece:
            out += hello[:3] + len(piece).to_bytes(2, "big") + piece
        at += size
    return out


@pytest.mark.parametrize("seed", range(60))
def test_the_client_hello_is_read_as_mitmproxy_reads_it(seed: int) -> None:
    """patches.client_hello restates mitmproxy's reading of a ClientHello (without its
    proxy core): the same answer on real ClientHellos, cut into records, cut short, and
    with bytes changed anywhere."""
    rng = random.Random(seed)
    name = rng.choice(["api.example.test", "x.test", None, "10.0.0.1", "a" * 63 + ".test"])
    alpn = rng.choice([None, ["http/1.1"], ["h2", "http/1.1"], ["x" * 200]])
    hello = client_hello(name, alpn)
    cases = [hello, _in_records(hello, [rng.randrange(1, 200), rng.randrange(1, 300)]),
             hello[:rng.randrange(len(hello))]]
    for _ in range(20):
        mutated = bytearray(rng.choice(cases[:2]))
        for _ in range(rng.randrange(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        cases.append(bytes(mutated))
    for data in cases:
        if data[:1] == b"\x16" and len(data) >= 3:  # (shorter: refused before either)
            assert _ours(data) == _mitmproxys(data), data
    assert _ours(hello) == (None if name in (None, "10.0.0.1") else name,
                            tuple(a.encode() for a in alpn or ()))


def _hello(*, suites: bytes = b"\x00\x02\x13\x01", after: bytes | None = None,
           extensions: Sequence[tuple[int, bytes]] = ()) -> bytes:
    """A ClientHello record built field by field: `suites` (its length field included),
    `after` the compression methods (else the extensions' list, framed)."""
    body = b"\x03\x03" + bytes(32) + b"\x00" + suites + b"\x01\x00"
    if after is None:
        listed = b"".join(kind.to_bytes(2, "big") + len(data).to_bytes(2, "big") + data
                          for kind, data in extensions)
        after = len(listed).to_bytes(2, "big") + listed if extensions else b""
    body += after
    message = b"\x01" + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + len(message).to_bytes(2, "big") + message


def _names(*entries: tuple[int, bytes]) -> bytes:
    listed = b"".join(bytes([t]) + len(n).to_bytes(2, "big") + n for t, n in entries)
    return len(listed).to_bytes(2, "big") + listed


def _protocols(*names: bytes) -> bytes:
    listed = b"".join(bytes([len(n)]) + n for n in names)
    return len(listed).to_bytes(2, "big") + listed


# The framings a mutation rarely makes, each read as mitmproxy reads it.
EDGES = [
    _hello(),  # no extensions at all
    _hello(suites=b"\x00\x03\x13\x01\x01"),  # an odd suites length: its last byte left over
    _hello(after=b"\x00"),  # the extensions' length cut
    _hello(after=b"\x00\x04\x00"),  # an extension's header cut
    _hello(after=b"\x00\x06\x00\x00\x00\x05\x00"),  # its body cut
    _hello(extensions=[(0, b"")]),  # an empty server_name
    _hello(extensions=[(0, b"\x00")]),  # its list's length cut
    _hello(extensions=[(0, _names((0, b"a.test"), (0, b"b.test")))]),  # two names: none
    _hello(extensions=[(0, _names((1, b"a.test")))]),  # not a host name
    _hello(extensions=[(0, _names((0, b"bad host"))), (0, _names((0, b"b.test")))]),
    _hello(extensions=[(0, _names((0, b"a.test"))[:-2])]),  # a name cut
    _hello(extensions=[(16, _protocols(b"h2")), (16, _protocols(b"x"))]),  # the first
    _hello(extensions=[(16, _protocols(b"", b"http/1.1"))]),  # an empty name kept
    _hello(extensions=[(16, b"\x00\x05\x09")]),  # a name cut
    _hello(extensions=[(16, b"")]),  # an empty ALPN
    _hello(extensions=[(0x2b, b"\x02\x03\x04"), (0, _names((0, b"a.test"))),
                       (16, _protocols(b"http/1.1"))]),
]


@pytest.mark.parametrize("data", EDGES)
def test_edge_framings_are_read_as_mitmproxy_reads_them(data: bytes) -> None:
    assert _ours(data) == _mitmproxys(data)
