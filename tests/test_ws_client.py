"""The tests' WebSocket client (tests/helpers/ws_client.py) against a real TLS server
that stalls: a handshake that gets no answer fails in about `open_timeout`, not never."""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.tls import LocalCA
from helpers.ws_client import IO_TIMEOUT, BoundedConnection, connect
from websockets.exceptions import ConnectionClosedError
from websockets.sync.server import ServerConnection, serve

HOST = "stall.test"


class Stalling:
    """A TLS server that completes the handshake, reads the upgrade request and answers
    with the first bytes of a TLS record, never the rest: the client's reading thread
    is left inside a record read (as a session ticket or a short read leaves it)."""

    def __init__(self, ca: LocalCA, directory: Path) -> None:
        self.ctx = ca.server_context(directory, [HOST])
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.requests: list[bytes] = []
        self.ended = threading.Event()  # the client's side of the connection ended
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        raw = conn.dup()  # (the same socket, written around the TLS session)
        try:
            with self.ctx.wrap_socket(conn, server_side=True) as tls:
                self.requests.append(tls.recv(65536))
                raw.sendall(b"\x17\x03\x03\x00\x40")  # a record of 64 bytes: none follow
                raw.settimeout(60)
                while raw.recv(65536):
                    pass
        except OSError:
            pass
        finally:
            self.ended.set()
            raw.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def test_ca(tmp_path: Path) -> LocalCA:
    return LocalCA.create(tmp_path, name="ws client CA")


@pytest.fixture
def stalling(test_ca: LocalCA, tmp_path: Path) -> Iterator[Stalling]:
    server = Stalling(test_ca, tmp_path)
    yield server
    server.close()


def test_an_unanswered_upgrade_fails_in_its_open_timeout(stalling: Stalling,
                                                         test_ca: LocalCA) -> None:
    """websockets' own client joins its reading thread with no timeout after its open
    timeout: with that thread inside the stalled record it never returned. This one
    raises TimeoutError after the open timeout and leaves no thread behind."""
    context = ssl.create_default_context(cafile=str(test_ca.cert_path))
    threads = threading.active_count()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="handshake response"):
        connect(f"wss://{HOST}:{stalling.port}/v1/realtime", open_timeout=2, ssl=context,
                sock=socket.create_connection(("127.0.0.1", stalling.port)))
    assert 1.5 < time.monotonic() - started < 5
    assert stalling.requests and stalling.requests[0].startswith(b"GET /v1/realtime ")
    assert stalling.ended.wait(5), "the client's connection was left open"
    assert threading.active_count() <= threads


class _Short(BoundedConnection):
    io_timeout = 1.0


def test_a_record_that_never_completes_ends_the_connection(test_ca: LocalCA,
                                                           tmp_path: Path) -> None:
    """Every read and write of the socket has a timeout (`IO_TIMEOUT`, longer than the
    keepalive's pings and their pongs; 1 s here): a peer that answers the upgrade, then
    starts a TLS record and stops, ends the connection instead of holding its reading
    thread (websockets' own waited for the record's end as long as the peer lived)."""
    assert IO_TIMEOUT > 20 + 5  # (websockets' default ping_interval, a pong's latency)
    release = threading.Event()

    def mute(conn: ServerConnection) -> None:
        raw = socket.socket(fileno=os.dup(conn.socket.fileno()))  # (around its TLS)
        with raw:
            raw.sendall(b"\x17\x03\x03\x00\x40")  # a record of 64 bytes: none follow
        release.wait(30)

    server = serve(mute, "127.0.0.1", 0, ssl=test_ca.server_context(tmp_path, [HOST]))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.socket.getsockname()[1]
        context = ssl.create_default_context(cafile=str(test_ca.cert_path))
        with connect(f"wss://{HOST}:{port}/", ssl=context, ping_interval=None,
                     create_connection=_Short,
                     sock=socket.create_connection(("127.0.0.1", port))) as ws:
            started = time.monotonic()
            with pytest.raises(ConnectionClosedError):
                ws.recv(timeout=20)
            assert time.monotonic() - started < 5
    finally:
        release.set()
        server.shutdown()
