"""The Node preload (gateway/sandbox/node-proxy-preload.mjs) in a real Node: fetch goes
through HTTPS_PROXY as a CONNECT tunnel with the proxy URL's credentials, NO_PROXY hosts
are reached directly, and a refused CONNECT's status line reaches the error. Everything
stays on 127.0.0.1 (the gateway itself is exercised in the client matrix)."""

from __future__ import annotations

import base64
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from fakes.tls_http import Recorder, TLSServer, serve_handler
from helpers.tls import LocalCA

PRELOAD = Path(__file__).resolve().parent.parent / "gateway" / "sandbox" / \
    "node-proxy-preload.mjs"
FETCH = ("fetch(process.argv[1]).then(r => r.text()).then(t => console.log('BODY', t),"
         " e => { console.log('ERROR', e.cause ? e.cause.message : e.message); })")

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")


class _Hello(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"hello")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TLSServer, LocalCA]]:
    ca = LocalCA.create(tmp_path_factory.mktemp("ca"))
    srv = serve_handler(_Hello, ca.server_context(tmp_path_factory.mktemp("leaf"),
                                                  ["127.0.0.1"]), Recorder())
    yield srv, ca
    srv.stop()


class RefusingProxy:
    """Reads one CONNECT head, answers a fixed refusal, keeps the head."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.heads: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def _serve(self) -> None:
        with self.sock:
            conn, _ = self.sock.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(4096)
            self.heads.append(data.decode("latin-1"))
            conn.sendall(b"HTTP/1.1 403 policy_denied: no rule allows it (hint)\r\n"
                         b"Proxy-Status: sandbox-gateway; error=http_request_denied\r\n"
                         b"Content-Length: 0\r\nConnection: close\r\n\r\n")


def _fetch(url: str, ca: LocalCA, **env: str) -> str:
    out = subprocess.run(["node", "-e", FETCH, url], capture_output=True, text=True,
                         timeout=30, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                          "NODE_OPTIONS": f"--import={PRELOAD}",
                                          "NODE_EXTRA_CA_CERTS": str(ca.cert_path), **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_no_proxy_hosts_are_reached_directly(server: tuple[TLSServer, LocalCA]) -> None:
    srv, ca = server
    dead = f"http://u:p@127.0.0.1:{_closed_port()}"
    url = f"https://127.0.0.1:{srv.port}/"
    assert _fetch(url, ca, HTTPS_PROXY=dead, NO_PROXY="localhost,127.0.0.1") == "BODY hello"
    # Not exempt: the preload sends it to the (dead) proxy; Node alone would not.
    assert "ECONNREFUSED" in _fetch(url, ca, HTTPS_PROXY=dead, NO_PROXY="")
    assert _fetch(url, ca, HTTPS_PROXY=dead, NO_PROXY="",
                  SANDBOX_GATEWAY_NODE_PROXY="off") == "BODY hello"


def test_connect_carries_the_proxy_credentials_and_the_refusal_reaches_the_error(
        server: tuple[TLSServer, LocalCA]) -> None:
    _, ca = server
    proxy = RefusingProxy()
    out = _fetch("https://api.example.test/v1/x", ca,
                 https_proxy=f"http://sbx-1:tok%2Fen@127.0.0.1:{proxy.port}")
    assert out == ("ERROR proxy refused CONNECT api.example.test:443: "
                   "403 policy_denied: no rule allows it (hint)")
    (head,) = proxy.heads
    lines = head.split("\r\n")
    assert lines[0] == "CONNECT api.example.test:443 HTTP/1.1"
    auth = base64.b64encode(b"sbx-1:tok/en").decode()
    assert f"Proxy-Authorization: Basic {auth}" in lines
