"""The CONNECT and SOCKS5 handshakes (gateway/net/proxy_handshake.py), byte for byte, and
`UpstreamProxy.open` against a fake proxy peer: leftover bytes reach the engine's
protocol, failures carry an outcome and never the proxy's words."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable, Callable

import pytest

from gateway.core.addresses import Pinned
from gateway.core.secret_value import SecretValue
from gateway.net.proxy_handshake import HttpConnect, ProxyFailed, Socks5Connect
from gateway.net.proxy_settings import ProxySettings
from gateway.net.upstream_proxy import MARK, ProxyDialFailed, UpstreamProxy

CREDS = SecretValue("corp:pa55-word")
BASIC = base64.b64encode(b"corp:pa55-word")


def test_http_connect_request() -> None:
    assert HttpConnect("10.1.2.3", 443, None).start() == \
        b"CONNECT 10.1.2.3:443 HTTP/1.1\r\nHost: 10.1.2.3:443\r\n\r\n"
    assert HttpConnect("2001:db8::1", 8443, CREDS).start() == (
        b"CONNECT [2001:db8::1]:8443 HTTP/1.1\r\nHost: [2001:db8::1]:8443\r\n"
        b"Proxy-Authorization: Basic " + BASIC + b"\r\n\r\n")


HTTP_ANSWERS = [
    ([b"HTTP/1.1 200 Connection established\r\n\r\n"], None, b""),
    ([b"HTTP/1.0 200 OK\r\nVia: x\r\n", b"\r\nSSH-2.0-banner"], None, b"SSH-2.0-banner"),
    ([b"HTTP/1.1 403 Forbidden\r\nX-Squid: secret words\r\n\r\nbody"], ("denied", 403), b""),
    ([b"HTTP/1.1 407 Proxy Auth\r\n\r\n"], ("auth_failed", 407), b""),
    ([b"HTTP/1.1 502 Bad Gateway\r\n\r\n"], ("refused", 502), b""),
    ([b"SSH-2.0-not-a-proxy\r\n\r\n"], ("protocol_error", None), b""),
    ([b"x" * 17000], ("protocol_error", None), b""),
    # read by h11, as every other head: informational answers first, a 2xx's body
    # headers ignored (the tunnel starts after the head), bare LF line ends
    ([b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\nhi"], None, b"hi"),
    ([b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nabcde"], None, b"abcde"),
    ([b"HTTP/1.1 200 OK\n\nx"], None, b"x"),
    ([b"HTTP/1.1 200 OK\r\nBad Header\r\n\r\n"], ("protocol_error", None), b""),
    ([b"HTTP/2 200\r\n\r\n"], ("protocol_error", None), b""),
]


@pytest.mark.parametrize(("chunks", "failure", "leftover"), HTTP_ANSWERS)
def test_http_connect_answers(chunks: list[bytes], failure: tuple[str, int | None] | None,
                              leftover: bytes) -> None:
    machine = HttpConnect("10.1.2.3", 443, CREDS)
    machine.start()
    try:
        for chunk in chunks:
            assert machine.feed(chunk) == b""
    except ProxyFailed as exc:
        assert failure == (exc.outcome, exc.status)
        assert "secret words" not in exc.reason and "body" not in exc.reason
        if exc.status is not None:
            assert str(exc.status) in exc.reason
        return
    assert failure is None and machine.done and machine.leftover == leftover


SOCKS_OK = b"\x05\x00\x00\x01\x0a\x01\x02\x03\x01\xbb"


def test_socks5_with_credentials_byte_for_byte() -> None:
    machine = Socks5Connect("10.1.2.3", 443, CREDS)
    assert machine.start() == b"\x05\x02\x00\x02"
    auth = machine.feed(b"\x05\x02")
    assert auth == b"\x01\x04corp\x09pa55-word"
    assert machine.feed(b"\x01\x00") == b"\x05\x01\x00\x01\x0a\x01\x02\x03\x01\xbb"
    assert machine.feed(SOCKS_OK[:3]) == b"" and not machine.done
    assert machine.feed(SOCKS_OK[3:] + b"early") == b""
    assert machine.done and machine.leftover == b"early"


def test_socks5_names_and_ipv6() -> None:
    named = Socks5Connect("api.example.com", 443, None)
    assert named.start() == b"\x05\x01\x00"
    assert named.feed(b"\x05\x00") == b"\x05\x01\x00\x03\x0fapi.example.com\x01\xbb"
    v6 = Socks5Connect("2001:db8::1", 80, None)
    v6.start()
    assert v6.feed(b"\x05\x00")[3:4] == b"\x04"
    # a reply with a domain-name bound address, all in one segment
    assert v6.feed(b"\x05\x00\x00\x03\x04host\x00\x50") == b"" and v6.done


SOCKS_FAILURES = [
    (b"\x05\xff", "auth_failed", None),
    (b"\x04\x00", "protocol_error", None),
    (b"\x05\x02\x01\x01", "auth_failed", 1),
    (b"\x05\x02\x01\x00\x05\x02\x00\x01" + bytes(6), "denied", 2),
    (b"\x05\x02\x01\x00\x05\x05\x00\x01" + bytes(6), "refused", 5),
    (b"\x05\x02\x01\x00\x05\x00\x00\x09" + bytes(6), "protocol_error", None),
]


@pytest.mark.parametrize(("answer", "outcome", "status"), SOCKS_FAILURES)
def test_socks5_failures(answer: bytes, outcome: str, status: int | None) -> None:
    machine = Socks5Connect("10.1.2.3", 443, CREDS)
    machine.start()
    with pytest.raises(ProxyFailed) as caught:
        machine.feed(answer)
    assert (caught.value.outcome, caught.value.status) == (outcome, status)


# -- UpstreamProxy.open against a fake peer ------------------------------------------------------


Peer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _with_peer(peer: Peer, check: Callable[[int], Awaitable[None]]) -> None:
    server = await asyncio.start_server(peer, "127.0.0.1", 0)
    try:
        await check(int(server.sockets[0].getsockname()[1]))
    finally:
        server.close()
        await server.wait_closed()


class Collect(asyncio.BufferedProtocol):
    """An engine's protocol (buffered, as the splice's upstream side is)."""

    def __init__(self) -> None:
        self.buf = bytearray(4)  # small: leftover is delivered in pieces
        self.data = b""
        self.made = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made = True

    def get_buffer(self, sizehint: int) -> bytearray:
        return self.buf

    def buffer_updated(self, nbytes: int) -> None:
        self.data += bytes(self.buf[:nbytes])


def _proxy(port: int, scheme: str = "http") -> UpstreamProxy:
    async def secret(name: str) -> SecretValue:
        assert name == "corp-proxy"
        return CREDS

    return UpstreamProxy(ProxySettings(scheme, "127.0.0.1", port, credentials="corp-proxy"),
                         secret=secret)


PINNED = Pinned("api.example.com", 443, "93.184.216.34")


def test_open_hands_the_tunnel_and_leftover_to_the_engine() -> None:
    seen: list[bytes] = []

    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\n\r\n220 banner\r\n")
        seen.append(await reader.readexactly(4))
        writer.write(b"pong")
        await writer.drain()
        writer.close()

    async def check(port: int) -> None:
        transport, protocol = await _proxy(port).open(PINNED, Collect, timeout=5)
        assert protocol.made
        transport.write(b"ping")
        for _ in range(100):
            if protocol.data.endswith(b"pong"):
                break
            await asyncio.sleep(0.01)
        transport.close()
        assert protocol.data == b"220 banner\r\npong"

    asyncio.run(_with_peer(peer, check))
    assert seen[0].startswith(b"CONNECT 93.184.216.34:443 HTTP/1.1\r\n")  # the checked IP
    assert b"Proxy-Authorization: Basic " + BASIC in seen[0]
    assert seen[1] == b"ping"


@pytest.mark.parametrize(("answer", "outcome"), [
    (b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n<html>squid</html>", "auth_failed"),
    (b"", "refused"),  # closed without an answer
])
def test_open_failures_are_named(answer: bytes, outcome: str) -> None:
    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    async def check(port: int) -> None:
        with pytest.raises(ProxyDialFailed) as caught:
            await _proxy(port).open(PINNED, Collect, timeout=5)
        assert caught.value.failure.outcome == outcome
        assert str(caught.value).startswith(MARK) and "squid" not in str(caught.value)

    asyncio.run(_with_peer(peer, check))


def test_open_unreachable_and_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never answers; until the dialler gives up
        writer.close()

    async def check(port: int) -> None:
        with pytest.raises(ProxyDialFailed) as caught:
            await _proxy(port).open(PINNED, Collect, timeout=0.2)
        assert caught.value.failure.outcome == "timeout"
        assert "0.2s" in caught.value.failure.reason

    asyncio.run(_with_peer(silent, check))

    async def refused() -> None:
        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = int(server.sockets[0].getsockname()[1])
        server.close()
        await server.wait_closed()
        with pytest.raises(ProxyDialFailed) as caught:
            await _proxy(port).open(PINNED, Collect, timeout=2)
        assert caught.value.failure.outcome == "unreachable"

    asyncio.run(refused())
