"""TLS on memory BIOs (gateway.net.tls): both ends of a session pumped in memory,
and leaf contexts minted from mitmproxy's certificate store for the gateway CA."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from mitmproxy import certs

from gateway.net import ca
from gateway.net.tls import LeafContexts, TlsClosed, TlsPump, upstream_context


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[certs.CertStore, Path]:
    directory = tmp_path_factory.mktemp("ca")
    cert, key = ca.ensure_ca(directory)
    confdir = ca.mitmproxy_confdir(cert, key, directory / "runtime")
    return certs.CertStore.from_store(str(confdir), "mitmproxy", 2048), cert


@pytest.fixture
def runtime(tmp_path: Path) -> Path:
    return tmp_path


def _pair(leaves: LeafContexts, cafile: Path, host: str) -> tuple[TlsPump, TlsPump,
                                                                  list[bytes], list[bytes]]:
    to_server: list[bytes] = []
    to_client: list[bytes] = []
    server = TlsPump(leaves.get(host), to_client.append, server_side=True)
    client = TlsPump(upstream_context(cafile), to_server.append, server_side=False,
                     server_hostname=host)
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


def test_no_session_tickets_after_the_handshake(store: tuple[certs.CertStore, Path],
                                                runtime: Path) -> None:
    """TLS 1.3 tickets come after the handshake, while a client may already be writing
    from another thread (the websockets sync client: 1 session in a few hundred hung):
    the sandbox-facing side sends none. Nothing reaches the client once it is done."""
    leaves = LeafContexts(store[0], runtime)
    try:
        assert leaves.get("api.example.test").num_tickets == 0
        client, server, to_server, to_client = _pair(leaves, store[1], "api.example.test")
        assert client.obj.version() == "TLSv1.3"
        assert to_client == []  # no post-handshake flight
        client.send(b"GET / HTTP/1.1\r\n\r\n")
        assert b"".join(server.feed(b) for b in to_server) == b"GET / HTTP/1.1\r\n\r\n"
        assert to_client == []
    finally:
        leaves.close()
