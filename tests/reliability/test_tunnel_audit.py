"""Every tunnel answered `200 Connection established` ends in exactly one audit line, the
ones that never carried a byte included (issue 21, item 9).

Before: a tunnel closed right after its 200 was never audited, passthrough or
intercepted, on the gateway's own engines; an intercepted one neither on mitmproxy.
"""

from __future__ import annotations

import base64
import socket
import ssl
import time
from typing import Any

import pytest
from helpers.gateway import GatewayFactory, GatewayThread
from helpers.nginx import Nginx
from helpers.tls import LocalCA

ENGINES = ["fast", "mitmproxy"]
TUNNELS = [("pass.test", "passthrough"), ("inspect.test", "intercept")]


def connect(gw: GatewayThread, token: str, host: str) -> socket.socket:
    assert gw.gateway.proxy_address
    sock = socket.create_connection(gw.gateway.proxy_address, timeout=10)
    cred = base64.b64encode(f"sandbox-1:{token}".encode()).decode()
    sock.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nProxy-Authorization: Basic {cred}"
                 "\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def tunnel_lines(gw: GatewayThread, host: str, expect: int = 1) -> list[dict[str, Any]]:
    """The audit lines of tunnels to `host`, once `expect` are there and a moment has
    passed for any extra one."""
    gw.audit.wait_for(lambda r: r["host"] == host and r["method"] == "CONNECT")
    deadline = time.monotonic() + 3
    while len([r for r in gw.audit.records() if r["host"] == host]) < expect \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    return [r for r in gw.audit.records() if r["host"] == host]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("host", "path"), TUNNELS)
def test_a_tunnel_closed_before_any_byte_is_audited_once(
        make_gateway: GatewayFactory, nginx: Nginx, engine: str, host: str,
        path: str) -> None:
    gw = make_gateway(nginx.port, config={"network": {"intercept": engine}})
    connect(gw, gw.mint("agent"), host).close()  # read the 200, close
    [line] = tunnel_lines(gw, host)
    assert (line["method"], line["status"], line["decision"], line["path_taken"]) == (
        "CONNECT", 200, "allow", path), line
    assert line["sandbox"] == "sandbox-1" and line["bytes_in"] in (0, None)


@pytest.mark.parametrize("engine", ENGINES)
def test_an_intercepted_tunnel_without_a_request_is_audited_once(
        make_gateway: GatewayFactory, nginx: Nginx, engine: str) -> None:
    """TLS done, no request, closed: one line (`no_request`); with requests, the
    requests' lines are the tunnel's and no extra line is added."""
    gw = make_gateway(nginx.port, config={"network": {"intercept": engine}})
    token = gw.mint("agent")
    ctx = ssl.create_default_context(cafile=str(gw.ca_cert))
    ctx.set_alpn_protocols(["http/1.1"])
    ctx.wrap_socket(connect(gw, token, "inspect.test"), server_hostname="inspect.test").close()
    [line] = tunnel_lines(gw, "inspect.test")
    assert (line["method"], line["status"], line["error"], line["path_taken"]) == (
        "CONNECT", 200, "no_request", "intercept"), line
    with ctx.wrap_socket(connect(gw, token, "inspect.test"),
                         server_hostname="inspect.test") as tls:
        tls.sendall(b"GET /small HTTP/1.1\r\nHost: inspect.test\r\n\r\n")
        assert tls.recv(65536).startswith(b"HTTP/1.1 200")
    lines = tunnel_lines(gw, "inspect.test", expect=2)
    assert [(r["method"], r["path"]) for r in lines] == [("CONNECT", None), ("GET", "/small")]


def test_a_tunnel_that_never_sends_its_first_bytes_is_audited_when_cut(
        make_gateway: GatewayFactory, nginx: Nginx, test_ca: LocalCA) -> None:
    gw = make_gateway(nginx.port, config={"network": {"timeouts": {"handshake": "1s"}}})
    sock = connect(gw, gw.mint("agent"), "pass.test")
    started = time.monotonic()
    sock.settimeout(5)
    assert sock.recv(1) == b""  # cut by the handshake timeout
    assert time.monotonic() - started < 3
    sock.close()
    [line] = tunnel_lines(gw, "pass.test")
    assert (line["error"], line["path_taken"], line["bytes_out"]) == (
        "handshake_timeout", "passthrough", 0), line
