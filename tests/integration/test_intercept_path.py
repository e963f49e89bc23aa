"""The HTTP/1 intercept path (`gateway.intercept`) against a real gateway and upstream:
what it serves itself, what it hands to mitmproxy, and how it frames HTTP/1.1."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers.gateway import GatewayFactory, GatewayThread
from helpers.tls import LocalCA
from helpers.upstream import Upstream

POLICY = """
version: v1
name: agent
egress:
  - host: other.test
    inspect: true
  - host: api.openai.com
    credential: openai
credentials:
  openai: {preset: openai, secret: openai-api-key}
"""
KEY = "sk-intercept-path-key-0123456789abcdef"


@pytest.fixture
def gw(make_gateway: GatewayFactory, tmp_path: Path) -> GatewayThread:
    secrets = tmp_path / "s.yaml"
    secrets.write_text(f"openai-api-key: {KEY}\n")
    secrets.chmod(0o600)
    return make_gateway({"agent.yaml": POLICY}, config={
        "secrets": {"store": "file", "path": str(secrets)},
        "network": {"upstream_idle_timeout": "1s"}})


@contextmanager
def tunnel(gw: GatewayThread, token: str, authority: str = "other.test:443",
           alpn: list[str] | None = None, sni: str | None = None) -> Iterator[ssl.SSLSocket]:
    """CONNECT through the gateway, then TLS (trusting the gateway CA) with `alpn`."""
    assert gw.gateway.proxy_address
    sock = socket.create_connection(gw.gateway.proxy_address, timeout=10)
    cred = base64.b64encode(f"sandbox-1:{token}".encode()).decode()
    sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n"
                 f"Proxy-Authorization: Basic {cred}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 200"), head
    ctx = ssl.create_default_context(cafile=gw.ca_cert)
    if alpn is not None:
        ctx.set_alpn_protocols(alpn)
    tls = ctx.wrap_socket(sock, server_hostname=sni or authority.rsplit(":", 1)[0])
    try:
        yield tls
    finally:
        tls.close()


def read_response(sock: ssl.SSLSocket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response (Content-Length or chunked, or none for HEAD-like)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {buf!r}")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
    status = int(status_line.split()[1])
    if "content-length" in headers:
        length = int(headers["content-length"])
        while len(rest) < length:
            rest += sock.recv(65536)
        return status, headers, rest[:length]
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            while b"\r\n" not in rest:
                rest += sock.recv(65536)
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            while len(rest) < size + 2:
                rest += sock.recv(65536)
            body, rest = body + rest[:size], rest[size + 2:]
            if size == 0:
                return status, headers, body
    return status, headers, rest


def test_keep_alive_reuses_one_upstream_connection(gw: GatewayThread, upstream: Upstream
                                                   ) -> None:
    token = gw.mint("agent")
    before = upstream.connections
    with tunnel(gw, token, alpn=["h2", "http/1.1"]) as s:
        assert s.selected_alpn_protocol() == "http/1.1"  # the intercept path speaks HTTP/1.1
        for i in range(5):
            s.sendall(f"GET /ka/{i} HTTP/1.1\r\nHost: other.test\r\n\r\n".encode())
            status, _, body = read_response(s)
            assert status == 200 and json.loads(body)["path"] == f"/ka/{i}"
    assert upstream.connections - before == 1
    lines = [json.loads(x) for x in gw.audit.getvalue().splitlines()]
    done = [x for x in lines if (x.get("path") or "").startswith("/ka/")]
    assert [x["path_taken"] for x in done] == ["intercept"] * 5
    assert all(x["status"] == 200 and x["bytes_in"] > 0 for x in done)


def test_pipelined_requests_are_answered_in_order(gw: GatewayThread, upstream: Upstream
                                                  ) -> None:
    token = gw.mint("agent")
    with tunnel(gw, token) as s:
        s.sendall(b"GET /p/1 HTTP/1.1\r\nHost: other.test\r\n\r\n"
                  b"POST /p/2 HTTP/1.1\r\nHost: other.test\r\nContent-Length: 3\r\n\r\nabc")
        first, second = read_response(s), read_response(s)
    assert json.loads(first[2])["path"] == "/p/1"
    assert json.loads(second[2])["path"] == "/p/2" and json.loads(second[2])["body"] == "abc"


def test_request_smuggling_shapes_are_refused(gw: GatewayThread, upstream: Upstream) -> None:
    token = gw.mint("agent")
    before = len(upstream.requests)
    with tunnel(gw, token) as s:
        s.sendall(b"POST /smuggle HTTP/1.1\r\nHost: other.test\r\nContent-Length: 4\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /hidden HTTP/1.1\r\n\r\n")
        status, headers, body = read_response(s)
    assert status == 400 and headers["x-sandbox-gateway-error"] == "bad_request"
    assert "request smuggling" in json.loads(body)["reason"]
    assert len(upstream.requests) == before


def test_missing_or_foreign_host_header(gw: GatewayThread, upstream: Upstream) -> None:
    token = gw.mint("agent")
    with tunnel(gw, token) as s:
        s.sendall(b"GET /x HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
        status, headers, _ = read_response(s)
        assert status == 403 and headers["x-sandbox-gateway-error"] == "host_mismatch"
        s.sendall(b"GET /x HTTP/1.1\r\n\r\n")  # still the same connection
        status, headers, _ = read_response(s)
    assert status == 400 and headers["x-sandbox-gateway-error"] == "bad_request"


def test_sni_must_name_the_tunnel(gw: GatewayThread) -> None:
    token = gw.mint("agent")
    with tunnel(gw, token, sni="other.test"):
        pass  # the matching case works; a different SNI is refused at the ClientHello
    ctx = ssl.create_default_context(cafile=gw.ca_cert)
    ctx.check_hostname = False  # the leaf is for the tunnel's host, not the SNI
    assert gw.gateway.proxy_address
    raw = socket.create_connection(gw.gateway.proxy_address, timeout=10)
    cred = base64.b64encode(f"sandbox-1:{token}".encode()).decode()
    raw.sendall(b"CONNECT other.test:443 HTTP/1.1\r\nProxy-Authorization: Basic "
                + cred.encode() + b"\r\n\r\n")
    assert raw.recv(4096).startswith(b"HTTP/1.1 200")
    with pytest.raises((ssl.SSLError, ConnectionError)):
        ctx.wrap_socket(raw, server_hostname="api.openai.com")  # cut off: no TLS at all
    raw.close()
    [line] = gw.audit.wait_for(lambda r: r["error"] == "host_mismatch")
    assert "TLS server name" in line["reason"] and line["host"] == "other.test"


def test_expect_continue_and_head(gw: GatewayThread, upstream: Upstream) -> None:
    token = gw.mint("agent")
    with tunnel(gw, token) as s:
        s.sendall(b"PUT /up HTTP/1.1\r\nHost: other.test\r\nContent-Length: 5\r\n"
                  b"Expect: 100-continue\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        s.sendall(b"hello")
        status, _, body = read_response(s)
        assert status == 200 and json.loads(body)["body"] == "hello"
        # A HEAD answer has a length but no body: the next request must still parse.
        s.sendall(b"HEAD /h HTTP/1.1\r\nHost: other.test\r\n\r\n")
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += s.recv(4096)
        assert buf.startswith(b"HTTP/1.1 200") and buf.endswith(b"\r\n\r\n")
        s.sendall(b"GET /after-head HTTP/1.1\r\nHost: other.test\r\n\r\n")
        status, _, body = read_response(s)
    assert status == 200 and json.loads(body)["path"] == "/after-head"


def test_refused_upload_waiting_for_continue_is_answered_at_once(gw: GatewayThread) -> None:
    """A refusal does not wait for a body the client holds back until `100 Continue`."""
    token = gw.mint("agent")
    with tunnel(gw, token, "api.openai.com:443") as s:
        s.settimeout(3)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: api.openai.com\r\n"
                  b"Content-Length: 100000\r\nExpect: 100-continue\r\n\r\n")
        status, headers, _ = read_response(s)
    assert status == 403 and headers["x-sandbox-gateway-error"] == "credential_not_in_scope"
    assert headers["connection"] == "close"


def test_head_with_injected_key_sends_no_body(gw: GatewayThread, upstream: Upstream) -> None:
    """The key swap turns responses chunked (redaction may change lengths); a HEAD
    answer must still carry no body, not even the chunked terminator."""
    token = gw.mint("agent")
    with tunnel(gw, token, "api.openai.com:443") as s:
        s.sendall(f"HEAD /v1/models HTTP/1.1\r\nHost: api.openai.com\r\n"
                  f"Authorization: Bearer {token}\r\n\r\n".encode())
        buf = b""
        while b"\r\n\r\n" not in buf:
            buf += s.recv(4096)
        s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: api.openai.com\r\n"
                  f"Authorization: Bearer {token}\r\n\r\n".encode())
        status, _, body = read_response(s)
    assert buf.startswith(b"HTTP/1.1 200") and buf.endswith(b"\r\n\r\n")
    assert status == 200 and json.loads(body)["path"] == "/v1/models"
    assert upstream.requests[-1].headers["authorization"] == f"Bearer {KEY}"


def test_idle_upstream_is_closed_and_reopened(gw: GatewayThread, upstream: Upstream) -> None:
    token = gw.mint("agent")
    before = upstream.connections
    with tunnel(gw, token) as s:
        s.sendall(b"GET /idle/1 HTTP/1.1\r\nHost: other.test\r\n\r\n")
        assert read_response(s)[0] == 200
        time.sleep(1.6)  # network.upstream_idle_timeout: 1s
        s.sendall(b"GET /idle/2 HTTP/1.1\r\nHost: other.test\r\n\r\n")
        assert read_response(s)[0] == 200
    assert upstream.connections - before == 2


def test_plain_http_inside_an_inspected_tunnel(gw: GatewayThread, upstream: Upstream) -> None:
    """Non-TLS bytes in an inspected tunnel are mitmproxy's to answer (as before the
    intercept path existed): the connection gets an answer, never a splice."""
    token = gw.mint("agent")
    assert gw.gateway.proxy_address
    before = len(upstream.requests)
    sock = socket.create_connection(gw.gateway.proxy_address, timeout=10)
    cred = base64.b64encode(f"sandbox-1:{token}".encode()).decode()
    sock.sendall(b"CONNECT other.test:443 HTTP/1.1\r\nProxy-Authorization: Basic "
                 + cred.encode() + b"\r\n\r\n")
    head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 200")
    sock.sendall(b"GET /plain HTTP/1.1\r\nHost: other.test\r\n\r\n")
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data:
                break
    except (ConnectionError, TimeoutError):
        pass
    sock.close()
    assert not data.startswith(b"HTTP/1.1 200 Connection established")
    assert all(r.path != "/plain" for r in upstream.requests[before:]) or data


def test_upstream_with_a_bad_certificate_is_502(make_gateway: GatewayFactory,
                                                upstream: Upstream) -> None:
    """Without network.upstream_ca the test upstream's certificate is not trusted."""
    gw = make_gateway({"agent.yaml": POLICY}, config={"network": {"upstream_ca": None}})
    token = gw.mint("agent")
    with tunnel(gw, token) as s:
        s.sendall(b"GET /x HTTP/1.1\r\nHost: other.test\r\n\r\n")
        status, headers, body = read_response(s)
    assert status == 502 and headers["x-sandbox-gateway-error"] == "upstream_failed"
    assert "certificate" in json.loads(body)["reason"]


@pytest.mark.parametrize("engine", ["fast", "mitmproxy"])
def test_a_malformed_answer_quoting_the_key_never_reaches_the_sandbox(
        make_gateway: GatewayFactory, test_ca: LocalCA, tmp_path: Path, engine: str) -> None:
    """The upstream echoes the injected key inside an unparsable status line: the 502
    says the answer was bad without quoting it (either path)."""
    (tmp_path / "leaf").mkdir()
    ctx = test_ca.server_context(tmp_path / "leaf", ["api.openai.com"])
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        with ctx.wrap_socket(conn, server_side=True) as tls:
            head = b""
            while b"\r\n\r\n" not in head:
                head += tls.recv(65536)
            auth = [ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"authorization")]
            tls.sendall(b"HTTP/1.1 abc " + auth[0] + b"\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    secrets = tmp_path / "s.yaml"
    secrets.write_text(f"openai-api-key: {KEY}\n")
    secrets.chmod(0o600)
    gw = make_gateway({"agent.yaml": POLICY}, config={
        "secrets": {"store": "file", "path": str(secrets)},
        "network": {"intercept": engine, "resolve": {"api.openai.com": f"127.0.0.1:{port}"}}})
    token = gw.mint("agent")
    with tunnel(gw, token, "api.openai.com:443") as s:
        s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: api.openai.com\r\n"
                  f"Authorization: Bearer {token}\r\n\r\n".encode())
        status, headers, body = read_response(s)
    thread.join(5)
    listener.close()
    assert status == 502 and headers["x-sandbox-gateway-error"] == "upstream_failed"
    assert KEY.encode() not in body and b"abc" not in body  # nothing the upstream sent
    assert KEY not in gw.audit.getvalue()


def test_an_upstream_that_never_answers_tls_times_out(make_gateway: GatewayFactory) -> None:
    """TCP accepted, no TLS answer: the request gets a 502 after the connect and
    handshake timeouts (network.timeouts)."""
    listener = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never speaks
    port = listener.getsockname()[1]
    try:
        gw = make_gateway({"agent.yaml": POLICY}, config={
            "network": {"resolve": {"other.test": f"127.0.0.1:{port}"},
                        "timeouts": {"connect": "0.5s", "handshake": "1s"}}})
        token = gw.mint("agent")
        started = time.monotonic()
        with tunnel(gw, token) as s:
            s.sendall(b"GET /x HTTP/1.1\r\nHost: other.test\r\n\r\n")
            status, headers, _ = read_response(s)
        assert status == 502 and headers["x-sandbox-gateway-error"] == "upstream_failed"
        assert time.monotonic() - started < 5
    finally:
        listener.close()
