"""Regression tests for findings of the enforcement-core review that are not a row of
the parity table: token binding, `Connection: close` answers, uniform audit lines, one
decision per hand-off."""

from __future__ import annotations

import base64
import json
import socket
import ssl

import pytest
from helpers.clients import open_tunnel, raw_connect
from helpers.gateway import GatewayFactory, GatewayThread
from helpers.upstream import Upstream

from gateway.core.audit import FIELDS
from gateway.observability import metrics

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
KEY = "sk-findings-key-0123456789abcdef"


@pytest.fixture
def gw(make_gateway: GatewayFactory, tmp_path: object) -> GatewayThread:
    from pathlib import Path

    secrets = Path(str(tmp_path)) / "s.yaml"
    secrets.write_text(f"openai-api-key: {KEY}\n")
    secrets.chmod(0o600)
    return make_gateway({"agent.yaml": POLICY},
                        config={"secrets": {"store": "file", "path": str(secrets)}})


def test_a_bound_token_is_refused_from_another_address(gw: GatewayThread) -> None:
    """Finding 8's defence: a token minted with a cidr binding works only from there."""
    assert gw.gateway.proxy_address
    here = gw.mint("agent", cidr=["127.0.0.1/32"])
    elsewhere = gw.mint("agent", cidr=["10.9.9.9/32"])
    status, _, _ = raw_connect(gw.gateway.proxy_address, "other.test:443", here)
    assert status == 200
    status, _, body = raw_connect(gw.gateway.proxy_address, "other.test:443", elsewhere)
    assert status == 407 and body is not None and body["error"] == "token_wrong_source"
    assert "10.9.9.9/32" in body["reason"]


def _tunnel(gw: GatewayThread, token: str) -> ssl.SSLSocket:
    assert gw.gateway.proxy_address
    sock = open_tunnel(gw.gateway.proxy_address, "api.openai.com:443", token)
    ctx = ssl.create_default_context(cafile=gw.ca_cert)
    return ctx.wrap_socket(sock, server_hostname="api.openai.com")


def test_connection_close_requests_get_their_answer(gw: GatewayThread,
                                                    upstream: Upstream) -> None:
    """Finding 12: with `Connection: close` the default engine often answered 502 ("the
    upstream closed the connection without a response") although the upstream had
    answered — every time for an answer echoing the key."""
    token = gw.mint("agent")
    for _ in range(20):
        with _tunnel(gw, token) as tls:
            tls.sendall(f"GET /echo-header/Authorization HTTP/1.1\r\nHost: api.openai.com\r\n"
                        f"Authorization: Bearer {token}\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while chunk := tls.recv(65536):
                data += chunk
        assert data.startswith(b"HTTP/1.1 200"), data[:200]
        assert KEY.encode() not in data and b"[REDACTED]" in data


def test_allow_and_deny_lines_have_the_same_fields(gw: GatewayThread,
                                                   upstream: Upstream) -> None:
    token = gw.mint("agent")
    assert gw.gateway.proxy_address
    raw_connect(gw.gateway.proxy_address, "evil.test:443", token)
    with _tunnel(gw, token) as tls:
        tls.sendall(f"GET /v1/models HTTP/1.1\r\nHost: api.openai.com\r\n"
                    f"Authorization: Bearer {token}\r\nConnection: close\r\n\r\n".encode())
        while tls.recv(65536):
            pass
    lines = gw.audit.wait_for(lambda r: r["decision"] == "allow")
    records = gw.audit.records()
    assert {r["decision"] for r in records} == {"allow", "deny"} and lines
    for record in records:
        assert list(record)[: len(FIELDS)] == list(FIELDS), record
        assert set(record) - set(FIELDS) <= {"time", "worker"}
        assert token not in json.dumps(record) and KEY not in json.dumps(record)


def test_an_http2_hand_off_is_decided_once(gw: GatewayThread, upstream: Upstream) -> None:
    """Finding 12: the decision-latency metric was recorded twice on a hand-off (the
    front door decided, then mitmproxy again)."""
    import h2.config
    import h2.connection

    token = gw.mint("agent")
    before = _decisions()
    assert gw.gateway.proxy_address
    sock = socket.create_connection(gw.gateway.proxy_address, timeout=10)
    cred = base64.b64encode(f"sandbox-1:{token}".encode()).decode()
    sock.sendall(f"CONNECT other.test:443 HTTP/1.1\r\nProxy-Authorization: Basic {cred}"
                 "\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    ctx = ssl.create_default_context(cafile=gw.ca_cert)
    ctx.set_alpn_protocols(["h2"])
    with ctx.wrap_socket(sock, server_hostname="other.test") as tls:
        assert tls.selected_alpn_protocol() == "h2"
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        conn.send_headers(1, [(":method", "GET"), (":scheme", "https"),
                              (":authority", "other.test"), (":path", "/h2")], end_stream=True)
        tls.sendall(conn.data_to_send())
        got = b""
        while b"/h2" not in got:
            chunk = tls.recv(65536)
            if not chunk:
                break
            for event in conn.receive_data(chunk):
                data = getattr(event, "data", b"")
                got += data if isinstance(data, bytes) else b""
            tls.sendall(conn.data_to_send())
    assert b"/h2" in got
    gw.audit.wait_for(lambda r: r["path"] == "/h2")
    # One decision for the tunnel (the front door's, handed over) and one for the request.
    assert _decisions() - before == 2


def _decisions() -> float:
    for family in metrics.DECISION_SECONDS.collect():
        for sample in family.samples:
            if sample.name.endswith("_count"):
                return float(sample.value)
    return 0.0


def test_audit_lines_name_the_policy_commit(make_gateway: GatewayFactory,
                                            tmp_path: object) -> None:
    """Issue 15: an audit line names the git commit of the policies that decided it."""
    import subprocess
    from pathlib import Path

    gw = make_gateway({"agent.yaml": POLICY}, config={"secrets": {"store": "env"}})
    policies = Path(str(tmp_path)) / "policies"
    git = ["git", "-C", str(policies), "-c", "user.email=t@example.com", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "policies"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    import time

    deadline = time.monotonic() + 5
    while gw.gateway.current_policies().revision != commit and time.monotonic() < deadline:
        time.sleep(0.1)  # the reloader notices the new commit
    token = gw.mint("agent")
    assert gw.gateway.proxy_address
    raw_connect(gw.gateway.proxy_address, "evil.test:443", token)
    [line] = gw.audit.wait_for(lambda r: r["host"] == "evil.test")
    assert line["policy_rev"] == commit
