"""Connection lifecycle against a real nginx: redial of closed keep-alives, tunnels that
end with their token or their lifetime, limits, drain (issue 11, items 3-6)."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import websockets.sync.server
from helpers import ws_client
from helpers.gateway import GatewayThread
from helpers.nginx import Nginx
from helpers.tls import LocalCA
from test_timeouts import tunnel


def _get(tls: ssl.SSLSocket, path: str, host: str = "inspect.test") -> bytes:
    tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = tls.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length")), 0)
    while len(body) < length:
        body += tls.recv(65536)
    return head


def test_a_closed_keep_alive_is_redialled(make_gateway, test_ca: LocalCA,
                                          tmp_path: Path) -> None:
    """nginx closes every upstream connection after 3 requests (keepalive_requests 3):
    requests in one tunnel went 200 200 502 on the default engine. Now: all 200."""
    (tmp_path / "ng").mkdir()
    nginx = Nginx(tmp_path / "ng", test_ca, ["pass.test", "inspect.test"],
                  extra="keepalive_requests 3; keepalive_timeout 1s;")
    try:
        gw: GatewayThread = make_gateway(nginx.port)
        token = gw.mint("agent")
        statuses = []
        with tunnel(gw, token) as tls:
            for i in range(12):
                statuses.append(_get(tls, "/small")[:12])
                if i == 8:
                    time.sleep(1.5)  # nginx's keepalive_timeout closes the idle connection
        assert statuses == [b"HTTP/1.1 200"] * 12, statuses
        # (nginx logs a request after its response is sent: the last line may trail it)
        deadline = time.monotonic() + 5
        while True:
            upstream = [line for line in nginx.access_lines() if "/small" in line]
            if len(upstream) >= 12 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(upstream) == 12
    finally:
        nginx.stop()


def test_revocation_and_expiry_close_open_tunnels(make_gateway, nginx: Nginx,
                                                  test_ca: LocalCA) -> None:
    """Requests inside an open passthrough tunnel passed after revoke and after expiry.
    Now the tunnel ends within about a second, audited with the reason."""
    gw: GatewayThread = make_gateway(nginx.port)
    token = gw.mint("agent")
    short = gw.mint("agent", ttl=2)
    revoked = tunnel(gw, token, "pass.test", test_ca.cert_path)
    expiring = tunnel(gw, short, "pass.test", test_ca.cert_path)
    for tls in (revoked, expiring):
        assert _get(tls, "/small", "pass.test").startswith(b"HTTP/1.1 200")
    jti = gw.gateway.tokens.verify(token).jti
    gw.call(gw.gateway.state.revoke(jti, time.time() + 3600))
    for tls in (revoked, expiring):
        tls.settimeout(5)
        started = time.monotonic()
        try:
            while tls.recv(65536):
                pass
        except (OSError, ssl.SSLError):
            pass
        assert time.monotonic() - started < 4.5
        tls.close()
    errors = {r["error"] for r in gw.audit.wait_for(lambda r: r["path_taken"] == "passthrough")}
    time.sleep(0.2)
    errors = {r["error"] for r in gw.audit.records() if r["path_taken"] == "passthrough"}
    assert errors == {"token_revoked", "token_expired"}


def test_max_tunnel_lifetime(make_gateway, nginx: Nginx, test_ca: LocalCA) -> None:
    gw: GatewayThread = make_gateway(nginx.port, config={"limits": {"max_tunnel_lifetime": "1s"}})
    tls = tunnel(gw, gw.mint("agent"), "pass.test", test_ca.cert_path)
    assert _get(tls, "/small", "pass.test").startswith(b"HTTP/1.1 200")
    tls.settimeout(5)
    started = time.monotonic()
    try:
        while tls.recv(65536):
            pass
    except (OSError, ssl.SSLError):
        pass
    assert time.monotonic() - started < 3
    tls.close()
    [line] = gw.audit.wait_for(lambda r: r["error"] == "max_tunnel_lifetime")
    assert line["path_taken"] == "passthrough"


def _connect_status(gw: GatewayThread, token: str, sandbox: str) -> tuple[int, socket.socket]:
    assert gw.gateway.proxy_address
    sock = socket.create_connection(gw.gateway.proxy_address, timeout=10)
    cred = base64.b64encode(f"{sandbox}:{token}".encode()).decode()
    sock.sendall(f"CONNECT pass.test:443 HTTP/1.1\r\nProxy-Authorization: Basic {cred}"
                 "\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    return int(head.split()[1]), sock


def test_connections_per_sandbox(make_gateway, nginx: Nginx) -> None:
    gw: GatewayThread = make_gateway(nginx.port,
                                     config={"limits": {"connections_per_sandbox": 3}})
    one, two = gw.mint("agent", sandbox="sbx-a"), gw.mint("agent", sandbox="sbx-b")
    held = [_connect_status(gw, one, "sbx-a") for _ in range(3)]
    assert [status for status, _ in held] == [200, 200, 200]
    status, extra = _connect_status(gw, one, "sbx-a")
    assert status == 429
    extra.close()
    other, other_sock = _connect_status(gw, two, "sbx-b")  # another sandbox is not starved
    assert other == 200
    other_sock.close()
    held[0][1].close()
    time.sleep(0.3)
    again, sock = _connect_status(gw, one, "sbx-a")
    assert again == 200
    for _, s in held[1:]:
        s.close()
    sock.close()
    [line] = gw.audit.wait_for(lambda r: r["error"] == "too_many_connections")
    assert line["sandbox"] == "sbx-a" and line["status"] == 429


def test_max_header_bytes(make_gateway, nginx: Nginx) -> None:
    gw: GatewayThread = make_gateway(nginx.port, config={"limits": {"max_header_bytes": "4k"}})
    token = gw.mint("agent")
    assert gw.gateway.proxy_address
    with socket.create_connection(gw.gateway.proxy_address, timeout=10) as s:
        s.sendall(b"CONNECT inspect.test:443 HTTP/1.1\r\nX-Big: " + b"a" * 8000 + b"\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 400 bad_request")
    with tunnel(gw, token) as tls:
        tls.sendall(b"GET /small HTTP/1.1\r\nHost: inspect.test\r\nX-Big: " + b"a" * 8000
                    + b"\r\n\r\n")
        assert tls.recv(65536).startswith(b"HTTP/1.1 400 bad_request")


def test_max_websocket_message(make_gateway, test_ca: LocalCA, tmp_path: Path) -> None:
    """A message over limits.max_websocket_message closes the WebSocket with 1009
    (messages are held whole for the leak check: the cap bounds memory)."""
    ctx = test_ca.server_context(tmp_path, ["inspect.test"])

    def echo(ws: Any) -> None:
        for message in ws:
            ws.send(message)

    server = websockets.sync.server.serve(echo, "127.0.0.1", 0, ssl=ctx, max_size=2**24)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.socket.getsockname()[1]
        gw: GatewayThread = make_gateway(port, config={"limits": {
            "max_websocket_message": "256k"}})
        token = gw.mint("agent")
        with ws_client.connect(
                "wss://inspect.test/echo", proxy=gw.proxy_url(token), max_size=2**24,
                ssl=ssl.create_default_context(cafile=gw.ca_cert)) as ws:
            ws.send(b"x" * 1000)
            assert ws.recv(timeout=5) == b"x" * 1000
            ws.send(b"y" * (1 << 20))
            with pytest.raises(websockets.exceptions.ConnectionClosed) as info:
                ws.recv(timeout=5)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1009
    finally:
        server.shutdown()


def test_drain_finishes_streams_and_refuses_new_connections(make_gateway, nginx: Nginx,
                                                            test_ca: LocalCA,
                                                            tmp_path: Path) -> None:
    """SIGTERM's first half: readiness 503 at once, no new connections, in-flight
    streams run to completion (here a 100 MB download at a throttled rate)."""
    gw: GatewayThread = make_gateway(nginx.port)
    token = gw.mint("agent")
    tls = tunnel(gw, token)
    tls.sendall(b"GET /big HTTP/1.1\r\nHost: inspect.test\r\n\r\n")
    first = tls.recv(65536)
    assert first.startswith(b"HTTP/1.1 200")
    idle = tunnel(gw, token)  # an idle keep-alive connection: closed by the drain
    assert _get(idle, "/small").startswith(b"HTTP/1.1 200")
    drained = threading.Event()
    threading.Thread(target=lambda: (gw.call(gw.gateway.drain(10)), drained.set()),
                     daemon=True).start()
    time.sleep(0.3)
    ready = urllib.request.Request(gw.admin + "/readyz")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(ready, timeout=5)
    assert info.value.code == 503 and b"draining" in info.value.read()
    assert gw.gateway.proxy_address
    with pytest.raises(OSError):
        socket.create_connection(gw.gateway.proxy_address, timeout=2).recv(1)
    received = len(first.partition(b"\r\n\r\n")[2])
    while received < 1024 * 1024:
        chunk = tls.recv(65536)
        assert chunk, f"the stream was cut at {received} bytes"
        received += len(chunk)
        time.sleep(0.001)
    assert received == 1024 * 1024  # the whole body (nginx's /big is 1 MiB here)
    assert drained.wait(5)
    idle.settimeout(1)
    assert idle.recv(1) == b""
    idle.close()
    tls.close()
    lines = gw.audit.wait_for(lambda r: r["path"] == "/big")
    assert lines[0]["status"] == 200 and lines[0]["error"] is None
    assert json.dumps(lines[0])
