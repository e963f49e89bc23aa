"""TLS on memory BIOs (gateway.net.tls): both ends of a session pumped in memory,
and leaf contexts minted from mitmproxy's certificate store for the gateway CA."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from mitmproxy import certs

from gateway.net import ca
from gateway.net.tls import BULK, LeafContexts, TlsClosed, TlsPump, upstream_context


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[certs.CertStore, Path]:
    directory = tmp_path_factory.mktemp("ca")
    cert, key = ca.ensure_ca(directory)
    confdir = ca.mitmproxy_confdir(cert, key, directory / "runtime")
    return certs.CertStore.from_store(str(confdir), "mitmproxy", 2048), cert


@pytest.fixture
def runtime(tmp_path: Path) -> Path:
    return tmp_path


def _pair(leaves: LeafContexts, cafile: Path, host: str, *,
          client_context: ssl.SSLContext | None = None,
          session: ssl.SSLSession | None = None) -> tuple[TlsPump, TlsPump,
                                                          list[bytes], list[bytes]]:
    to_server: list[bytes] = []
    to_client: list[bytes] = []
    server = leaves.server(host, to_client.append)
    client = TlsPump(client_context or upstream_context(cafile), to_server.append,
                     server_side=False, server_hostname=host)
    if session is not None:
        client.obj.session = session
    client.start()
    for _ in range(5):  # handshake round trips
        while to_server:
            assert server.feed(to_server.pop(0)) == b""
        while to_client:
            client.feed(to_client.pop(0))
    assert client.established and server.established
    return client, server, to_server, to_client


def test_a_session_carries_bytes_both_ways(store: tuple[certs.CertStore, Path],
                                           runtime: Path) -> None:
    leaves = LeafContexts(store[0], runtime)
    try:
        client, server, to_server, to_client = _pair(leaves, store[1], "api.example.test")
        assert client.alpn == server.alpn == "http/1.1"
        client.send(b"GET / HTTP/1.1\r\n\r\n")
        assert b"".join(server.feed(b) for b in to_server) == b"GET / HTTP/1.1\r\n\r\n"
        to_server.clear()
        big = b"x" * 200_000  # more than one TLS record and one read
        server.send(big)
        assert b"".join(client.feed(b) for b in to_client) == big
        to_client.clear()
        client.close()
        with pytest.raises(TlsClosed):
            for b in to_server:
                server.feed(b)
    finally:
        leaves.close()


@pytest.mark.parametrize("cut", [BULK, 40_000, 49_157, 262_144, 1 << 20])
def test_bulk_ciphertext_yields_all_of_its_plaintext(store: tuple[certs.CertStore, Path],
                                                     runtime: Path, cut: int) -> None:
    """Ciphertext fed in pieces of `BULK` bytes or more is read into one buffer per feed
    (`TlsPump._read_into`): pieces cut anywhere in a record (its start then waits inside
    OpenSSL) give back every byte, in order; a close_notify in the last piece ends the
    session after the data before it."""
    leaves = LeafContexts(store[0], runtime)
    try:
        client, server, _to_server, to_client = _pair(leaves, store[1], "api.example.test")
        big = bytes(range(256)) * 4099  # (not a whole number of records)
        server.send(big)
        server.close()
        ciphertext = b"".join(to_client)
        pieces = [ciphertext[i:i + cut] for i in range(0, len(ciphertext), cut)]
        if len(pieces[-1]) < BULK and len(pieces) > 1:  # (every feed a bulk one)
            pieces[-2:] = [pieces[-2] + pieces[-1]]
        got = [client.feed(piece) for piece in pieces]
        assert b"".join(got) == big
        assert all(isinstance(g, bytearray) for g in got) and client.peer_closed
    finally:
        leaves.close()


def test_the_leaf_names_the_host_and_is_signed_by_the_gateway_ca(
        store: tuple[certs.CertStore, Path], runtime: Path) -> None:
    leaves = LeafContexts(store[0], runtime)
    try:
        _pair(leaves, store[1], "10.1.2.3")  # IP hosts get an IP SAN
        wrong: list[bytes] = []
        server = TlsPump(leaves.get("a.test"), wrong.append, server_side=True)
        client_out: list[bytes] = []
        client = TlsPump(upstream_context(store[1]), client_out.append, server_side=False,
                         server_hostname="b.test")
        client.start()
        server.feed(client_out.pop(0))
        with pytest.raises(ssl.SSLCertVerificationError):
            for b in wrong:
                client.feed(b)
    finally:
        leaves.close()


def test_contexts_are_cached_and_bounded(store: tuple[certs.CertStore, Path],
                                        runtime: Path) -> None:
    leaves = LeafContexts(store[0], runtime, limit=2)
    try:
        first = leaves.get("one.test")
        assert leaves.get("one.test") is first
        leaves.get("two.test")
        leaves.get("three.test")  # evicts the least recently used ("one.test")
        assert leaves.get("one.test") is not first
        key = Path(leaves._dir.name) / "leaf.key"
        assert key.parent.parent == runtime
        assert key.stat().st_mode & 0o777 == 0o600 and key.parent.stat().st_mode & 0o777 == 0o700
    finally:
        leaves.close()
    assert not key.exists()


def _exchange(client: TlsPump, server: TlsPump, to_server: list[bytes],
              to_client: list[bytes]) -> bytes:
    """One request and its answer; returns what the client read."""
    client.send(b"GET / HTTP/1.1\r\n\r\n")
    assert b"".join(server.feed(b) for b in to_server) == b"GET / HTTP/1.1\r\n\r\n"
    to_server.clear()
    server.send(b"HTTP/1.1 204 No Content\r\n\r\n")
    answer = b"".join(client.feed(b) for b in to_client)
    to_client.clear()
    return answer


def _ticket(leaves: LeafContexts, cafile: Path, host: str,
            client_context: ssl.SSLContext) -> ssl.SSLSession:
    client, server, to_server, to_client = _pair(leaves, cafile, host,
                                                 client_context=client_context)
    assert not server.obj.session_reused
    _exchange(client, server, to_server, to_client)
    session = client.obj.session
    assert session is not None and session.has_ticket
    return session


def test_tickets_wait_for_the_first_answer(store: tuple[certs.CertStore, Path],
                                           runtime: Path) -> None:
    """TLS 1.3 tickets come after the handshake, while a client may already be writing
    from another thread (the websockets sync client: 1 session in a few hundred hung
    when they were sent at once): the sandbox side holds them until its first answer and
    sends them in front of it, in the same write."""
    leaves = LeafContexts(store[0], runtime)
    try:
        assert leaves.get("api.example.test").num_tickets == 0  # a leaf alone sends none
        client, server, to_server, to_client = _pair(leaves, store[1], "api.example.test")
        assert client.obj.version() == "TLSv1.3"
        assert to_client == []  # no post-handshake flight
        client.send(b"GET / HTTP/1.1\r\n\r\n")
        assert b"".join(server.feed(b) for b in to_server) == b"GET / HTTP/1.1\r\n\r\n"
        assert to_client == []  # still nothing while the request is read
        server.send(b"HTTP/1.1 204 No Content\r\n\r\n")
        assert len(to_client) == 1  # ticket and answer in one write
        assert client.feed(to_client.pop()) == b"HTTP/1.1 204 No Content\r\n\r\n"
        assert client.obj.session is not None and client.obj.session.has_ticket
    finally:
        leaves.close()


def test_held_tickets_go_before_a_close(store: tuple[certs.CertStore, Path],
                                        runtime: Path) -> None:
    """Records are numbered: a ticket sealed and held cannot be left out of the stream."""
    leaves = LeafContexts(store[0], runtime)
    try:
        client, server, _, to_client = _pair(leaves, store[1], "api.example.test")
        server.close()
        assert len(to_client) == 1
        with pytest.raises(TlsClosed):
            client.feed(to_client.pop())
        assert client.obj.session is not None and client.obj.session.has_ticket
    finally:
        leaves.close()


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2])
def test_a_session_resumes_on_every_host_of_the_worker(
        store: tuple[certs.CertStore, Path], runtime: Path, version: ssl.TLSVersion) -> None:
    """Tickets are sealed with the front context's key, whichever leaf served the
    session; a TLS 1.2 server's last flight (its ticket, Finished) is not held."""
    leaves = LeafContexts(store[0], runtime)
    try:
        ctx = upstream_context(store[1])
        ctx.maximum_version = version
        session = _ticket(leaves, store[1], "one.test", ctx)
        for host in ("one.test", "two.test"):
            client, server, to_server, to_client = _pair(leaves, store[1], host,
                                                         client_context=ctx, session=session)
            assert client.obj.version() == version.name.replace("v1_", "v1.")
            assert client.obj.session_reused and server.obj.session_reused
            assert _exchange(client, server, to_server, to_client) \
                == b"HTTP/1.1 204 No Content\r\n\r\n"
        client, server, _, _ = _pair(leaves, store[1], "two.test", client_context=ctx)
        assert not server.obj.session_reused  # no session offered: a full handshake
        assert client.obj.getpeercert()["subject"] == ((("commonName", "two.test"),),)
    finally:
        leaves.close()


def test_the_ticket_key_is_replaced(store: tuple[certs.CertStore, Path],
                                    runtime: Path) -> None:
    """After `ticket_key_lifetime` a new front context (a new random key) seals and opens
    tickets: an older ticket gets a full handshake, which gives a new one."""
    now = [0.0]
    leaves = LeafContexts(store[0], runtime, ticket_key_lifetime=60.0, clock=lambda: now[0])
    try:
        ctx = upstream_context(store[1])
        old = _ticket(leaves, store[1], "api.example.test", ctx)
        first = leaves.front
        now[0] = 59.0
        client, server, _, _ = _pair(leaves, store[1], "api.example.test",
                                     client_context=ctx, session=old)
        assert server.obj.session_reused and leaves.front is first
        now[0] = 60.0
        client, server, to_server, to_client = _pair(leaves, store[1], "api.example.test",
                                                     client_context=ctx, session=old)
        assert leaves.front is not first
        assert not client.obj.session_reused and not server.obj.session_reused
        _exchange(client, server, to_server, to_client)
        new = client.obj.session
        client, server, _, _ = _pair(leaves, store[1], "api.example.test",
                                     client_context=ctx, session=new)
        assert server.obj.session_reused
    finally:
        leaves.close()
