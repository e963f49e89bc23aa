"""Every wait has a timeout; a client that leaves frees its upstream (issue 11, item 2)."""

from __future__ import annotations

import base64
import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from helpers.gateway import GatewayThread
from helpers.nginx import Nginx
from helpers.tls import LocalCA

TIMEOUTS = {"connect": "2s", "read": "1s", "client_idle": "1s", "handshake": "1s"}


class Silent:
    """A TLS upstream that reads requests and never answers (to `/half...`, a head and
    the first chunk of a body, then nothing); records when each connection of its ends
    (what the gateway did with it)."""

    def __init__(self, ca: LocalCA, workdir: Path, names: list[str]) -> None:
        self.ctx = ca.server_context(workdir, names)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.requests = 0
        self.closed: list[float] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with self.ctx.wrap_socket(conn, server_side=True) as tls:
                data = b""
                while True:
                    chunk = tls.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                    if b"\r\n\r\n" in data:
                        self.requests += 1
                        if data.startswith(b"GET /half"):
                            tls.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                                        b"Content-Type: text/plain\r\n\r\n5\r\nhello\r\n")
                        data = b""
        except (OSError, ssl.SSLError):
            pass
        self.closed.append(time.monotonic())

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def silent(test_ca: LocalCA, tmp_path: Path) -> Iterator[Silent]:
    (tmp_path / "silent").mkdir()
    server = Silent(test_ca, tmp_path / "silent", ["pass.test", "inspect.test"])
    yield server
    server.close()


def connected(gw: GatewayThread, token: str, host: str = "inspect.test",
              sandbox: str = "sandbox-1") -> socket.socket:
    """A tunnel to `host`:443 through the gateway, CONNECT answered 200."""
    assert gw.gateway.proxy_address
    sock = socket.create_connection(gw.gateway.proxy_address, timeout=10)
    cred = base64.b64encode(f"{sandbox}:{token}".encode()).decode()
    sock.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nProxy-Authorization: Basic {cred}"
                 "\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def tunnel(gw: GatewayThread, token: str, host: str = "inspect.test",
           cafile: Path | None = None, sandbox: str = "sandbox-1") -> ssl.SSLSocket:
    sock = connected(gw, token, host, sandbox)
    ctx = ssl.create_default_context(cafile=str(cafile or gw.ca_cert))
    return ctx.wrap_socket(sock, server_hostname=host)


@pytest.mark.parametrize("engine", ["fast", "mitmproxy"])
def test_an_upstream_that_never_answers_gets_504(make_gateway, silent: Silent,
                                                 engine: str) -> None:
    """network.timeouts.read on every engine (mitmproxy's own waits had no bound but its
    600 s idle timeout): the same answer, one audit line, the upstream connection closed."""
    gw: GatewayThread = make_gateway(silent.port, config={"network": {
        "intercept": engine, "timeouts": TIMEOUTS}})
    token = gw.mint("agent")
    started = time.monotonic()
    with tunnel(gw, token) as tls:
        tls.sendall(b"GET /slow HTTP/1.1\r\nHost: inspect.test\r\n\r\n")
        answer = tls.recv(65536)
    assert answer.startswith(b"HTTP/1.1 504 upstream_timeout"), answer[:100]
    assert b"sent nothing for too long (no response within 1s)" in answer, answer
    assert time.monotonic() - started < 5
    [line] = gw.audit.wait_for(lambda r: r["error"] == "upstream_timeout")
    assert line["status"] == 504 and line["path"] == "/slow"
    deadline = time.monotonic() + 3
    while not silent.closed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert silent.closed, "the gateway kept the upstream connection after the timeout"


@pytest.mark.parametrize("engine", ["fast", "mitmproxy"])
def test_a_client_that_leaves_frees_its_upstream(make_gateway, silent: Silent,
                                                 engine: str) -> None:
    """A sandbox that gives up before an answer: the upstream connection is closed at
    once, and the line says the client closed it (not that the upstream failed)."""
    gw: GatewayThread = make_gateway(silent.port, config={"network": {"intercept": engine,
                                                                      "timeouts": {
        **TIMEOUTS, "read": "60s"}}})
    token = gw.mint("agent")
    tls = tunnel(gw, token)
    tls.sendall(b"GET /long HTTP/1.1\r\nHost: inspect.test\r\n\r\n")
    deadline = time.monotonic() + 3
    while silent.requests == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert silent.requests == 1
    left = time.monotonic()
    tls.close()  # the sandbox gives up
    while not silent.closed and time.monotonic() < left + 3:
        time.sleep(0.02)
    assert silent.closed and silent.closed[0] - left < 2
    [line] = gw.audit.wait_for(lambda r: r["path"] == "/long")
    assert (line["error"], line["status"]) == ("connection_closed", None), line


@pytest.mark.parametrize("engine", ["fast", "mitmproxy"])
def test_a_client_that_leaves_mid_answer_is_audited_with_the_status_it_got(
        make_gateway, silent: Silent, engine: str) -> None:
    """A sandbox that closes its connection once it has what it wants (an agent CLI after
    the stream's last event) is audited with the status it was answered, and the cut."""
    gw: GatewayThread = make_gateway(silent.port, config={"network": {"intercept": engine,
                                                                      "timeouts": {
        **TIMEOUTS, "read": "60s"}}})
    token = gw.mint("agent")
    tls = tunnel(gw, token)
    tls.sendall(b"GET /half HTTP/1.1\r\nHost: inspect.test\r\n\r\n")
    got = b""
    deadline = time.monotonic() + 5
    while b"hello" not in got and time.monotonic() < deadline:
        got += tls.recv(65536)
    assert got.startswith(b"HTTP/1.1 200") and b"hello" in got, got[:200]
    tls.close()
    [line] = gw.audit.wait_for(lambda r: r["path"] == "/half")
    assert (line["status"], line["error"]) == (200, "connection_closed"), line


def test_idle_connections_end(make_gateway, nginx: Nginx, test_ca: LocalCA) -> None:
    """An intercepted connection and a passthrough tunnel that carry nothing for
    client_idle are closed (and the tunnel audited)."""
    gw: GatewayThread = make_gateway(nginx.port, config={"network": {"timeouts": TIMEOUTS}})
    token = gw.mint("agent")
    for host, cafile in (("inspect.test", None), ("pass.test", test_ca.cert_path)):
        tls = tunnel(gw, token, host, cafile)
        tls.sendall(f"GET /small HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        first = tls.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first[:80]
        started = time.monotonic()
        tls.settimeout(5)
        try:
            while tls.recv(65536):
                pass
        except (OSError, ssl.SSLError):
            pass
        assert 0.8 < time.monotonic() - started < 3.5, host
        tls.close()
    [line] = gw.audit.wait_for(lambda r: r["path_taken"] == "passthrough")
    assert line["error"] == "idle_timeout"


def test_slow_heads_are_cut_and_others_still_served(make_gateway, nginx: Nginx) -> None:
    """Slowloris: 150 connections sending CONNECT heads and request heads byte by byte
    are closed after the handshake timeout; meanwhile another sandbox is served fast."""
    gw: GatewayThread = make_gateway(nginx.port, config={"network": {"timeouts": TIMEOUTS}})
    token = gw.mint("agent")
    assert gw.gateway.proxy_address
    slow: list[socket.socket] = []
    try:
        for _ in range(100):
            s = socket.create_connection(gw.gateway.proxy_address, timeout=10)
            s.sendall(b"CONNECT inspect.test:443 HTTP/1.1\r\nX-Slow: ")
            slow.append(s)
        for _ in range(50):  # inside a tunnel: TLS done, then a head that never ends
            tls = tunnel(gw, token)
            tls.sendall(b"GET /small HTTP/1.1\r\nHost: inspect.test\r\nX-Slow: ")
            slow.append(tls)
        latencies = []
        other = gw.mint("agent", sandbox="sandbox-2")
        for _ in range(40):
            started = time.monotonic()
            with tunnel(gw, other, sandbox="sandbox-2") as tls:
                tls.sendall(b"GET /small HTTP/1.1\r\nHost: inspect.test\r\n"
                            b"Connection: close\r\n\r\n")
                assert tls.recv(65536).startswith(b"HTTP/1.1 200")
            latencies.append(time.monotonic() - started)
        ranked = sorted(latencies)
        # The other sandbox's median and p95 (one scheduling hiccup on a shared CI
        # machine is not starvation; 150 held connections would make every call slow).
        assert ranked[len(ranked) // 2] < 0.1 and ranked[int(len(ranked) * 0.95) - 1] < 0.5, \
            latencies
        time.sleep(2.5)
        for s in slow:
            s.settimeout(1)
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                assert s.recv(1) == b""  # closed by the gateway
    finally:
        for s in slow:
            s.close()


# -- issue 21, item 10: malformed chunk sizes at once; timeouts name their phase ----------

@pytest.mark.parametrize("engine", ["fast", "mitmproxy"])
@pytest.mark.parametrize("size", [b"ffffffffffffffffffff", b"10000000000000000",
                                  b"fffffffffffffffffffff", b"-1", b"zz"])
def test_a_malformed_chunk_size_is_a_400_at_once(make_gateway, nginx: Nginx, engine: str,
                                                 size: bytes) -> None:
    """h11 reads up to 20 hex digits: `ffffffffffffffffffff` (2**80 - 1) was taken as a
    size and the connection held until client_idle; a size past 63 bits is now refused
    like any malformed one, with one audit line. mitmproxy never answers a malformed
    request body on HTTP/1 (its HTTP/1 server closes the connection before reporting the
    error, so there is nothing to write the 400 to): there the connection is closed at
    once, and the audit line says 400 bad_request."""
    gw: GatewayThread = make_gateway(nginx.port, config={"network": {
        "intercept": engine, "timeouts": {**TIMEOUTS, "client_idle": "30s"}}})
    started = time.monotonic()
    with tunnel(gw, gw.mint("agent")) as tls:
        tls.settimeout(5)
        tls.sendall(b"POST /small HTTP/1.1\r\nHost: inspect.test\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n" + size + b"\r\nabc")
        try:
            answer = tls.recv(65536)
        except (ConnectionError, ssl.SSLError):
            answer = b""
    if engine == "fast":
        assert answer.startswith(b"HTTP/1.1 400 bad_request"), answer[:100]
    else:
        assert answer == b"", answer[:100]
    assert time.monotonic() - started < 2
    lines = gw.audit.wait_for(lambda r: r["path"] == "/small")
    time.sleep(0.2)
    assert [(r["status"], r["error"]) for r in gw.audit.records()
            if r["path"] == "/small"] == [(400, "bad_request")], lines


class AcceptOnly:
    """An upstream that accepts TCP connections and never speaks (no TLS handshake)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.conns.append(self.sock.accept()[0])

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


class Backlogged:
    """An upstream whose accept queue is full: a TCP connect to it never completes."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(0)
        self.port = int(self.sock.getsockname()[1])
        self.filler = socket.create_connection(("127.0.0.1", self.port))  # fills it

    def close(self) -> None:
        self.filler.close()
        self.sock.close()


@pytest.mark.parametrize("engine", ["fast", "mitmproxy"])
@pytest.mark.parametrize(("server", "phase", "seconds"), [
    (AcceptOnly, "TCP connected but no TLS handshake within 1s", 1.0),
    (Backlogged, "no TCP connection within 1s", 1.0),
])
def test_a_dial_that_times_out_names_its_phase(make_gateway, server: type, phase: str,
                                               seconds: float, engine: str) -> None:
    """The dial's two waits are bounded each by its own timeout (connect, then
    handshake) and the answer says which one ran out; a handshake that never started
    was reported "no connection within <connect>s" after connect + handshake. On
    mitmproxy too (it bounded neither: the request hung until its 600 s idle timeout)."""
    upstream = server()
    try:
        gw: GatewayThread = make_gateway(upstream.port, config={"network": {
            "intercept": engine,
            "timeouts": {**TIMEOUTS, "connect": "1s", "handshake": "1s"}}})
        with tunnel(gw, gw.mint("agent")) as tls:
            tls.settimeout(10)
            started = time.monotonic()
            tls.sendall(b"GET /x HTTP/1.1\r\nHost: inspect.test\r\n\r\n")
            answer = tls.recv(65536)
            took = time.monotonic() - started
    finally:
        upstream.close()
    assert answer.startswith(b"HTTP/1.1 502 upstream_failed"), answer[:120]
    assert phase.encode() in answer, answer[:400]
    assert seconds * 0.9 < took < seconds + 0.7, took
    [line] = gw.audit.wait_for(lambda r: r["path"] == "/x")
    assert (line["status"], line["error"]) == (502, "upstream_failed"), line


# -- the mitmproxy engine's read timeout ends one HTTP/2 stream, and no WebSocket --------

class H2Upstream:
    """A TLS upstream speaking HTTP/2 only: `/slow` is never answered, `/late` after
    0.7 s, `/stall` a head and 4 bytes of its body at once, then nothing; records its
    connections and the paths of the streams reset by the gateway."""

    def __init__(self, ca: LocalCA, workdir: Path, names: list[str]) -> None:
        self.ctx = ca.server_context(workdir, names)
        self.ctx.set_alpn_protocols(["h2"])
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.connections = 0
        self.reset: list[str] = []
        self.conns: list[ssl.SSLSocket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                self.connections += 1
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        import h2.config
        import h2.connection
        import h2.events

        lock = threading.Lock()
        paths: dict[int, str] = {}
        with contextlib.suppress(OSError, ssl.SSLError), \
                self.ctx.wrap_socket(raw, server_side=True) as tls:
            self.conns.append(tls)
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
            conn.initiate_connection()
            tls.sendall(conn.data_to_send())

            def answer(stream: int) -> None:
                with lock, contextlib.suppress(Exception):
                    conn.send_headers(stream, [(":status", "200"), ("content-length", "4")])
                    conn.send_data(stream, b"late", end_stream=True)
                    tls.sendall(conn.data_to_send())

            while data := tls.recv(65536):
                with lock:
                    for event in conn.receive_data(data):
                        if isinstance(event, h2.events.RequestReceived):
                            path = dict(event.headers)[b":path"].decode()
                            paths[event.stream_id] = path
                            if path == "/late":
                                threading.Timer(0.7, answer, (event.stream_id,)).start()
                            elif path == "/stall":  # a head, part of a body, silence
                                conn.send_headers(event.stream_id, [(":status", "200")])
                                conn.send_data(event.stream_id, b"part")
                        elif isinstance(event, h2.events.StreamReset):
                            self.reset.append(paths.get(event.stream_id, "?"))
                    tls.sendall(conn.data_to_send())

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.close()


def _h2_two_streams(gw: GatewayThread, first: str
                    ) -> tuple[dict[int, str], dict[int, bytes], dict[int, float], set[int]]:
    """On one HTTP/2 connection through the gateway: GET `first` (stream 1), 0.8 s later
    GET /late (stream 3: answered 0.7 s later, within `read` but after stream 1's timer
    ran out, with 0.5 s to spare on a loaded machine); each stream's status, body, when
    it ended (s after the first request) and which ended by a reset."""
    import h2.config
    import h2.connection

    sock = connected(gw, gw.mint("agent"))
    ctx = ssl.create_default_context(cafile=str(gw.ca_cert))
    ctx.set_alpn_protocols(["h2"])
    with ctx.wrap_socket(sock, server_hostname="inspect.test") as tls:
        assert tls.selected_alpn_protocol() == "h2"
        client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        client.initiate_connection()

        def get(stream: int, path: str) -> None:
            client.send_headers(stream, [(":method", "GET"), (":scheme", "https"),
                                         (":authority", "inspect.test"),
                                         (":path", path)], end_stream=True)
            tls.sendall(client.data_to_send())

        started = time.monotonic()
        get(1, first)
        time.sleep(0.8)
        get(3, "/late")
        seen = H2Seen(started)
        seen.until_ended(tls, client, {1, 3})
    return seen.status, seen.bodies, seen.ended, seen.reset


class H2Seen:
    """What an HTTP/2 client read, by stream: status, body, when it ended (seconds
    after `started`), and which streams ended by a reset."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.status: dict[int, str] = {}
        self.bodies: dict[int, bytes] = {}
        self.ended: dict[int, float] = {}
        self.reset: set[int] = set()

    def until_ended(self, tls: ssl.SSLSocket, client: Any, streams: set[int]) -> None:
        """Read `client`'s (an h2 connection's) events from `tls` until every one of
        `streams` ended."""
        import h2.events

        for stream in streams:
            self.bodies.setdefault(stream, b"")
        while not streams <= set(self.ended):
            data = tls.recv(65536)
            assert data, (self.status, self.bodies)
            for event in client.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    self.status[event.stream_id] = dict(event.headers)[b":status"].decode()
                elif isinstance(event, h2.events.DataReceived):
                    self.bodies[event.stream_id] += event.data
                    client.acknowledge_received_data(event.flow_controlled_length,
                                                     event.stream_id)
                elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                    self.ended[event.stream_id] = time.monotonic() - self.started
                    if isinstance(event, h2.events.StreamReset):
                        self.reset.add(event.stream_id)
            tls.sendall(client.data_to_send())


@pytest.mark.parametrize("engine", ["fast", "mitmproxy"])
@pytest.mark.parametrize(("first", "status", "body", "reset"), [
    ("/slow", "504", b"no response within 1s", set()),  # no head: the answer is a 504
    ("/stall", "200", b"part", {1}),  # a head, 4 bytes, silence: the stream is reset
])
def test_a_read_timeout_ends_its_http2_stream_alone(make_gateway, test_ca: LocalCA,
                                                     tmp_path: Path, engine: str,
                                                     first: str, status: str, body: bytes,
                                                     reset: set[int]) -> None:
    """mitmproxy (which serves HTTP/2 on both settings of network.intercept) multiplexes
    a client's HTTP/2 streams on one upstream connection: the stream that timed out (no
    head within `read`, or a pause of `read` mid-body) is reset upstream and answered
    504, or reset if its head went out; audited `upstream_timeout` with the status the
    client got; the stream sent after it on the same connection is still answered
    (closing the connection would cut it). (A stalled body was held until mitmproxy's
    600 s idle timeout.)"""
    (tmp_path / "h2").mkdir()
    upstream = H2Upstream(test_ca, tmp_path / "h2", ["inspect.test"])
    try:
        gw: GatewayThread = make_gateway(upstream.port, config={"network": {
            "intercept": engine, "timeouts": TIMEOUTS}})
        statuses, bodies, ended, resets = _h2_two_streams(gw, first)
    finally:
        upstream.close()
    assert statuses == {1: status, 3: "200"} and resets == reset, (statuses, resets)
    assert body in bodies[1] and bodies[3] == b"late", bodies
    assert 0.9 < ended[1] < 2.5 and ended[3] > ended[1], ended
    assert upstream.connections == 1 and upstream.reset == [first], \
        (upstream.connections, upstream.reset)
    gw.audit.wait_for(lambda r: r["path"] == "/late")
    lines = {r["path"]: (r["status"], r["error"]) for r in gw.audit.records()}
    assert lines == {first: (int(status), "upstream_timeout"), "/late": (200, None)}, lines


@pytest.mark.parametrize("engine", ["fast", "mitmproxy"])
def test_an_http2_stream_the_client_resets_mid_answer_is_audited_as_its_leaving(
        make_gateway, test_ca: LocalCA, tmp_path: Path, engine: str) -> None:
    """An HTTP/2 client that resets its stream once it has what it wants: the upstream's
    stream is reset, and the line holds the status answered and the client's leaving
    (`connection_closed`), not an upstream failure (mitmproxy reports either as text
    only: the side is read from its typed event, `patches.install_error_sides`)."""
    import h2.config
    import h2.connection
    import h2.errors

    (tmp_path / "h2").mkdir()
    upstream = H2Upstream(test_ca, tmp_path / "h2", ["inspect.test"])
    try:
        gw: GatewayThread = make_gateway(upstream.port, config={"network": {
            "intercept": engine, "timeouts": {**TIMEOUTS, "read": "60s"}}})
        ctx = ssl.create_default_context(cafile=str(gw.ca_cert))
        ctx.set_alpn_protocols(["h2"])
        with ctx.wrap_socket(connected(gw, gw.mint("agent")),
                             server_hostname="inspect.test") as tls:
            client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            client.initiate_connection()
            client.send_headers(1, [(":method", "GET"), (":scheme", "https"),
                                    (":authority", "inspect.test"), (":path", "/stall")],
                                end_stream=True)
            tls.sendall(client.data_to_send())
            got = b""
            while b"part" not in got:
                data = tls.recv(65536)
                assert data
                got += b"".join(getattr(e, "data", b"") for e in client.receive_data(data))
            client.reset_stream(1, h2.errors.ErrorCodes.CANCEL)
            tls.sendall(client.data_to_send())
            [line] = gw.audit.wait_for(lambda r: r["path"] == "/stall")
            deadline = time.monotonic() + 3
            while upstream.reset != ["/stall"] and time.monotonic() < deadline:
                time.sleep(0.02)
    finally:
        upstream.close()
    assert (line["status"], line["error"]) == (200, "connection_closed"), line
    assert upstream.reset == ["/stall"]


def test_a_websocket_outlives_the_read_timeout(make_gateway, test_ca: LocalCA,
                                               tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """The 101 ends the wait for a response head: a WebSocket on the mitmproxy engine
    carries messages for longer than network.timeouts.read (its timer's late wakeup
    is dropped, not handed to the WebSocket layer)."""
    from fakes.ws_echo import WsEcho
    from helpers.ws_client import connect as ws_connect

    (tmp_path / "ws").mkdir()
    echo = WsEcho(tmp_path / "ws", test_ca, ["inspect.test"])
    try:
        gw: GatewayThread = make_gateway(echo.port, config={"network": {
            "intercept": "mitmproxy", "timeouts": {**TIMEOUTS, "client_idle": "30s"}}})
        ctx = ssl.create_default_context(cafile=str(gw.ca_cert))
        with ws_connect("wss://inspect.test/echo", ssl=ctx,
                        proxy=gw.proxy_url(gw.mint("agent")), close_timeout=2) as ws:
            started = time.monotonic()
            i = 0
            while time.monotonic() - started < 2.5:  # past read (1s) twice over
                ws.send(f"message {i}")
                assert ws.recv(timeout=5) == f"message {i}"
                time.sleep(0.2)
                i += 1
    finally:
        echo.stop()
    [line] = gw.audit.wait_for(lambda r: r["path"] == "/echo")
    assert line["status"] == 101 and line["error"] is None, line
    crashed = [r.getMessage()[:300] for r in caplog.records if r.levelno >= logging.ERROR]
    assert not crashed, crashed  # (the wakeup handed on made mitmproxy's layers crash)




# -- network.timeouts.read inside a response body, on every engine -----------------------

class Stalling:
    """A TLS HTTP/1 upstream whose answers pause mid-body: `/cl` sends a head of
    Content-Length 100 and 10 bytes, `/chunked` a chunked head and one chunk, `/sse` an
    event stream's head and one event, then each says nothing more (the connection held
    open); `/sse-live` sends an event every 0.2 s for 3 s (`?n=`: n events), then ends;
    anything else is answered at once (100 bytes). Records when each connection ends."""

    BODIES: ClassVar[dict[str, bytes]] = {
        "/cl": b"Content-Length: 100\r\n\r\n" + b"x" * 10,
        "/chunked": b"Transfer-Encoding: chunked\r\n\r\na\r\n" + b"x" * 10 + b"\r\n",
        "/sse": b"Content-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                b"\r\n9\r\ndata: 0\n\n\r\n"}

    def __init__(self, ca: LocalCA, workdir: Path, names: list[str]) -> None:
        self.ctx = ca.server_context(workdir, names)
        self.ctx.set_alpn_protocols(["http/1.1"])
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.closed: list[float] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError, ssl.SSLError), \
                self.ctx.wrap_socket(conn, server_side=True) as tls:
            data = b""
            while chunk := tls.recv(65536):
                data += chunk
                while b"\r\n\r\n" in data:
                    head, _, data = data.partition(b"\r\n\r\n")
                    path = head.split(b" ")[1].decode()
                    if path in self.BODIES:
                        tls.sendall(b"HTTP/1.1 200 OK\r\n" + self.BODIES[path])
                    elif path.startswith("/sse-live"):
                        self._live(tls, int(path.partition("?n=")[2] or 15))
                    else:
                        tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n"
                                    + b"s" * 99 + b"\n")
        self.closed.append(time.monotonic())

    @staticmethod
    def _live(tls: ssl.SSLSocket, events: int) -> None:
        tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n")
        for i in range(events):
            event = f"data: {i:02d}\n\n".encode()
            tls.sendall(b"%x\r\n%s\r\n" % (len(event), event))
            time.sleep(0.2)
        tls.sendall(b"0\r\n\r\n")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def stalling(test_ca: LocalCA, tmp_path: Path) -> Iterator[Stalling]:
    (tmp_path / "stalling").mkdir()
    server = Stalling(test_ca, tmp_path / "stalling", ["inspect.test"])
    yield server
    server.close()


def _read_until_closed(tls: ssl.SSLSocket, limit: float) -> tuple[bytes, float]:
    """What the gateway sends until it closes the connection, and when the last of it
    came (time.monotonic())."""
    tls.settimeout(limit)
    received, last = b"", time.monotonic()
    with contextlib.suppress(ConnectionError, ssl.SSLError):
        while chunk := tls.recv(65536):
            received, last = received + chunk, time.monotonic()
    return received, last


# The same audit line on both engines for a response cut off by `read` (compared field by
# field: the fields left out vary between runs, and `engine`); `bytes_in`, what of the
# upstream's body went to the client.
CUT_OFF = {"status": 200, "error": "upstream_timeout", "bytes_out": 0, "decision": "allow",
           "path_taken": "intercept", "method": "GET", "host": "inspect.test",
           "port": 443, "rule": "policies/agent.yaml:6", "credential": None}


@pytest.mark.parametrize("engine", ["fast", "mitmproxy"])
@pytest.mark.parametrize(("path", "sent"), [
    ("/cl", b"x" * 10), ("/chunked", b"a\r\n" + b"x" * 10 + b"\r\n"),
    ("/sse", b"9\r\ndata: 0\n\n\r\n")])
def test_a_response_body_that_stalls_is_cut_off(make_gateway, stalling: Stalling,
                                                engine: str, path: str, sent: bytes) -> None:
    """`read` bounds each pause inside a response body too: a head and part of a body
    (Content-Length, chunked, an event stream), then silence, is cut off `read` after
    the last byte (the body left incomplete, the client's connection closed), the
    upstream's connection closed, the exchange audited `upstream_timeout` with the
    status that went out: the same on both engines (mitmproxy held it until its own
    600 s idle timeout)."""
    gw: GatewayThread = make_gateway(stalling.port, config={"network": {
        "intercept": engine, "timeouts": {**TIMEOUTS, "client_idle": "30s"}}})
    with tunnel(gw, gw.mint("agent")) as tls:
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: inspect.test\r\n\r\n".encode())
        received, last = _read_until_closed(tls, 10)
        closed = time.monotonic()
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), received[:200]
    assert body == sent, body  # (no end: no 0-size chunk, 10 of 100 bytes)
    assert 0.8 < closed - last < 2.5, closed - last
    [line] = gw.audit.wait_for(lambda r: r["path"] == path)
    assert {k: line[k] for k in CUT_OFF} == CUT_OFF, line
    assert line["bytes_in"] == len(b"data: 0\n\n" if path == "/sse" else b"x" * 10), line
    deadline = time.monotonic() + 3
    while not stalling.closed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stalling.closed, "the gateway kept the upstream connection after the timeout"


@pytest.mark.parametrize("engine", ["fast", "mitmproxy"])
def test_an_event_stream_that_keeps_sending_outlives_read(make_gateway, stalling: Stalling,
                                                          engine: str) -> None:
    """An event stream with an event every 0.2 s runs 3 s under read=1s, whole: `read`
    bounds each pause, not the response (the body's timer is moved on by every part)."""
    gw: GatewayThread = make_gateway(stalling.port, config={"network": {
        "intercept": engine, "timeouts": {**TIMEOUTS, "client_idle": "30s"}}})
    with tunnel(gw, gw.mint("agent")) as tls:
        tls.settimeout(10)
        started = time.monotonic()
        tls.sendall(b"GET /sse-live HTTP/1.1\r\nHost: inspect.test\r\n\r\n")
        received = b""
        while not received.endswith(b"\r\n0\r\n\r\n"):
            chunk = tls.recv(65536)
            assert chunk, received[-200:]
            received += chunk
        took = time.monotonic() - started
    events = [e for e in received.split(b"\r\n") if e.startswith(b"data: ")]
    assert events == [f"data: {i:02d}\n\n".encode() for i in range(15)], received[-300:]
    assert took > 2.8, took
    [line] = gw.audit.wait_for(lambda r: r["path"] == "/sse-live")
    assert (line["status"], line["error"]) == (200, None), line


async def _timers() -> int:
    """mitmproxy's wakeup timer tasks in the gateway's loop, once those called off have
    run their last step (the client may read the answer's end, and ask, before it)."""
    import asyncio
    await asyncio.sleep(0.01)
    return sum(t.get_name().startswith("wakeup timer") for t in asyncio.all_tasks())


def _get(tls: ssl.SSLSocket, path: str, end: bytes) -> bytes:
    tls.sendall(f"GET {path} HTTP/1.1\r\nHost: inspect.test\r\n\r\n".encode())
    answer = b""
    while not answer.endswith(end):
        chunk = tls.recv(65536)
        assert chunk, answer
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:100]
    return answer


def test_answered_requests_leave_no_read_timer(make_gateway, nginx: Nginx) -> None:
    """Each request's read timer ends with its answer: 20 requests on one kept-alive
    tunnel leave no timer task behind (one left per request would hold its flow for
    `read` seconds: 5 min by default)."""
    gw: GatewayThread = make_gateway(nginx.port, config={"network": {
        "intercept": "mitmproxy", "timeouts": {**TIMEOUTS, "read": "60s",
                                               "client_idle": "30s"}}})
    with tunnel(gw, gw.mint("agent")) as tls:
        tls.settimeout(10)
        for _ in range(20):
            _get(tls, "/small", b"s" * 99 + b"\n")
        assert gw.call(_timers()) == 0


def test_streamed_bodies_leave_no_read_timer(make_gateway, stalling: Stalling) -> None:
    """The read timer of a response body ends with it too: answers streamed in parts
    (an event stream's events 0.2 s apart) and quick ones on one kept-alive tunnel, and
    a stalled answer whose client went away, leave no timer task behind (`read` 60 s: a
    timer left would still be there)."""
    gw: GatewayThread = make_gateway(stalling.port, config={"network": {
        "intercept": "mitmproxy", "timeouts": {**TIMEOUTS, "read": "60s",
                                               "client_idle": "30s"}}})
    token = gw.mint("agent")
    with tunnel(gw, token) as tls:
        tls.settimeout(10)
        for _ in range(3):
            _get(tls, "/small", b"s" * 99 + b"\n")
            _get(tls, "/sse-live?n=3", b"\r\n0\r\n\r\n")
        assert gw.call(_timers()) == 0
        with tunnel(gw, token) as stalled:
            stalled.settimeout(10)
            _get(stalled, "/cl", b"x" * 10)
            assert gw.call(_timers()) == 1  # (the stalled body's, moved on by its parts)
        deadline = time.monotonic() + 3
        while gw.call(_timers()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gw.call(_timers()) == 0  # (its client went away)
        _get(tls, "/small", b"s" * 99 + b"\n")


def _client_hello(name: str) -> bytes:
    """A TLS client's first flight for `name` (what a passthrough tunnel is chosen by)."""
    tls = ssl.create_default_context().wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO(),
                                                server_hostname=name)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return out.read()


@pytest.mark.parametrize("engine", ["fast", "mitmproxy"])
def test_a_passthrough_dial_that_times_out_closes_its_tunnel(make_gateway,
                                                             engine: str) -> None:
    """A passthrough tunnel to an upstream whose TCP connect never completes (its
    accept queue full: SYNs dropped) is closed `connect` after its first bytes, its
    audit line `upstream_failed`; on mitmproxy too (`connect` bounds its dials through
    the adapter's pinned dial: it bounded none)."""
    upstream = Backlogged()
    try:
        gw: GatewayThread = make_gateway(upstream.port, config={"network": {
            "intercept": engine,
            "timeouts": {**TIMEOUTS, "connect": "1s", "client_idle": "30s"}}})
        with connected(gw, gw.mint("agent"), "pass.test") as sock:
            started = time.monotonic()
            sock.sendall(_client_hello("pass.test"))
            with contextlib.suppress(ConnectionError):
                assert sock.recv(65536) == b""
            took = time.monotonic() - started
    finally:
        upstream.close()
    assert 0.9 < took < 1.7, took
    [line] = gw.audit.wait_for(lambda r: r["path_taken"] == "passthrough")
    assert (line["host"], line["error"]) == ("pass.test", "upstream_failed"), line


# -- an answer refused at its head is answered at once, the upstream cut -------------------

class HeadThenStall(Stalling):
    """A TLS upstream that answers every request with a head the gateway refuses (a
    content coding it cannot decode to look for the key it injected) and then sends
    nothing more; records when each of its connections ends."""

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError, ssl.SSLError), \
                self.ctx.wrap_socket(conn, server_side=True) as tls:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = tls.recv(65536)
                if not chunk:
                    return
                data += chunk
            tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Encoding: x-unknown\r\n"
                        b"Content-Length: 1000\r\n\r\n")
            while tls.recv(65536):  # (silence: until the gateway lets go)
                pass
        self.closed.append(time.monotonic())


CREDENTIAL_POLICY = """
version: v1
name: agent
egress:
  - host: inspect.test
    credential: k
credentials:
  k: {hosts: [inspect.test], secret: head-key, inject: {bearer: true}}
"""


@pytest.mark.parametrize("engine", ["fast", "mitmproxy"])
def test_an_answer_refused_at_its_head_is_answered_at_once(
        make_gateway, test_ca: LocalCA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        engine: str) -> None:
    """An upstream whose head the gateway refuses (here a content coding it cannot
    decode, on a call it injected a key into) and that then sends nothing: the client
    gets the whole refusal at once and the upstream's connection is let go, on both
    engines. (The mitmproxy engine sent the refusal's body only with the upstream's first
    body bytes, and held the upstream until its answer ended: with `read` at 60 s the
    client waited that long.)"""
    monkeypatch.setenv("SANDBOX_GATEWAY_SECRET_HEAD_KEY", "sk-head-refused-0123456789")
    (tmp_path / "stall").mkdir()
    upstream = HeadThenStall(test_ca, tmp_path / "stall", ["inspect.test"])
    try:
        gw: GatewayThread = make_gateway(upstream.port, CREDENTIAL_POLICY, config={
            "network": {"intercept": engine, "timeouts": {**TIMEOUTS, "read": "60s"}}})
        token = gw.mint("agent")
        started = time.monotonic()
        with tunnel(gw, token) as tls:
            tls.settimeout(5)
            tls.sendall(f"GET /x HTTP/1.1\r\nHost: inspect.test\r\n"
                        f"Authorization: Bearer {token}\r\n\r\n".encode())
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += tls.recv(65536)
            head, _, body = answer.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")))
            while len(body) < length:
                body += tls.recv(65536)
        took = time.monotonic() - started
        assert head.startswith(b"HTTP/1.1 502 upstream_failed"), head
        assert b"content coding" in body and b"sk-head" not in answer
        assert took < 3, took
        deadline = time.monotonic() + 3
        while not upstream.closed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert upstream.closed, "the gateway held the upstream after refusing its answer"
        [line] = gw.audit.wait_for(lambda r: r["path"] == "/x")
        assert (line["status"], line["error"]) == (502, "upstream_failed")
    finally:
        upstream.close()


def test_an_answer_refused_at_its_head_ends_its_http2_stream_at_once(
        make_gateway, test_ca: LocalCA, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on HTTP/2 (served by mitmproxy under either setting): the stream gets
    the whole refusal and ends; the connection goes on (a second request on it is
    refused the same way)."""
    import h2.config
    import h2.connection

    monkeypatch.setenv("SANDBOX_GATEWAY_SECRET_HEAD_KEY", "sk-head-refused-0123456789")
    (tmp_path / "stall").mkdir()
    upstream = HeadThenStall(test_ca, tmp_path / "stall", ["inspect.test"])
    try:
        gw: GatewayThread = make_gateway(upstream.port, CREDENTIAL_POLICY, config={
            "network": {"timeouts": {**TIMEOUTS, "read": "60s"}}})
        token = gw.mint("agent")
        ctx = ssl.create_default_context(cafile=str(gw.ca_cert))
        ctx.set_alpn_protocols(["h2"])
        started = time.monotonic()
        with ctx.wrap_socket(connected(gw, token), server_hostname="inspect.test") as tls:
            tls.settimeout(5)
            assert tls.selected_alpn_protocol() == "h2"
            client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            client.initiate_connection()
            seen = H2Seen(started)
            for stream in (1, 3):
                client.send_headers(stream, [
                    (":method", "GET"), (":scheme", "https"), (":authority", "inspect.test"),
                    (":path", "/x"), ("authorization", f"Bearer {token}")], end_stream=True)
                tls.sendall(client.data_to_send())
                seen.until_ended(tls, client, {stream})
        assert time.monotonic() - started < 3
        assert seen.status == {1: "502", 3: "502"} and not seen.reset, seen.status
        assert all(b"content coding" in seen.bodies[s] for s in (1, 3)), seen.bodies
    finally:
        upstream.close()
