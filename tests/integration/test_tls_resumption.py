"""TLS session resumption for sandboxes on the HTTP/1 engine (gateway/net/tls.py), with
real clients through the real gateway: Python's ssl with a session passed back, and
`openssl s_client -sess_out/-sess_in` through the proxy.

A resumed session skips the certificate and the key exchange, nothing else: who is
asking comes from each tunnel's own Proxy-Authorization, so a session resumed with a
revoked token, or with another sandbox's token, is refused or served as that token says.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from helpers.clients import open_tunnel
from helpers.gateway import GatewayFactory, GatewayThread
from helpers.upstream import Upstream

POLICIES = {
    "agent.yaml": """
version: v1
name: agent
egress:
  - host: other.test
    inspect: true
""",
    "narrow.yaml": """
version: v1
name: narrow
egress:
  - host: allowed.test
    inspect: true
""",
}


@pytest.fixture
def gw(make_gateway: GatewayFactory, upstream: Upstream) -> GatewayThread:
    # Refusals inside TLS (the default): a refused CONNECT still gets a TLS session, which
    # a client can then try to resume.
    return make_gateway(POLICIES, config={"refusals": {"inside_tls": True}})


@dataclass(frozen=True)
class Session:
    """What a client saw of one TLS session."""

    version: str | None
    reused: bool
    session: ssl.SSLSession | None


def _get(gw: GatewayThread, context: ssl.SSLContext, token: str, sandbox: str,
         session: ssl.SSLSession | None = None) -> tuple[bytes, Session]:
    """One request on a new tunnel to other.test; (the answer's status line, the
    session)."""
    assert gw.gateway.proxy_address is not None
    sock = open_tunnel(gw.gateway.proxy_address, "other.test:443", token, sandbox, timeout=5)
    with context.wrap_socket(sock, server_hostname="other.test", session=session) as tls:
        tls.sendall(b"GET / HTTP/1.1\r\nHost: other.test\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := tls.recv(65536):
            answer += chunk
        return answer.partition(b"\r\n")[0], Session(tls.version(), tls.session_reused,
                                                      tls.session)


def _client(gw: GatewayThread) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(gw.ca_cert))


def test_a_sandbox_resumes_its_session(gw: GatewayThread) -> None:
    context = _client(gw)
    token = gw.mint("agent", "sbx-a")
    head, first = _get(gw, context, token, "sbx-a")
    assert head == b"HTTP/1.1 200 OK" and not first.reused
    assert first.version == "TLSv1.3" and first.session is not None
    assert first.session.has_ticket
    session = first.session
    for _ in range(2):  # a ticket opens more than one session
        head, again = _get(gw, context, token, "sbx-a", session)
        assert head == b"HTTP/1.1 200 OK" and again.reused
    # TLS 1.2 resumes too.
    context12 = _client(gw)
    context12.maximum_version = ssl.TLSVersion.TLSv1_2
    _, first12 = _get(gw, context12, token, "sbx-a")
    head, again12 = _get(gw, context12, token, "sbx-a", first12.session)
    assert head == b"HTTP/1.1 200 OK" and again12.version == "TLSv1.2"
    assert again12.reused


def test_a_resumed_session_carries_no_identity(gw: GatewayThread) -> None:
    """The session of sbx-a's tunnel, resumed with a revoked token, with another
    sandbox's token and with a token whose policy does not allow the host: each tunnel
    is answered as its own Proxy-Authorization says."""
    context = _client(gw)
    token = gw.mint("agent", "sbx-a")
    _, first = _get(gw, context, token, "sbx-a")
    session = first.session
    other = gw.mint("agent", "sbx-b")
    head, resumed = _get(gw, context, other, "sbx-b", session)
    assert head == b"HTTP/1.1 200 OK" and resumed.reused
    lines = gw.audit.wait_for(lambda r: r.get("sandbox") == "sbx-b" and r.get("path") == "/")
    assert [(r["sandbox"], r["decision"]) for r in lines] == [("sbx-b", "allow")]
    narrow = gw.mint("narrow", "sbx-n")
    head, resumed = _get(gw, context, narrow, "sbx-n", session)
    assert resumed.reused and head.startswith(b"HTTP/1.1 403"), head
    jti = gw.gateway.tokens.verify(token).jti
    answer = httpx.post(f"{gw.admin}/v1/tokens/revoke", json={"jti": jti},
                        headers={"Authorization": f"Bearer {gw.gateway.admin_token}"})
    assert answer.status_code == 200
    head, resumed = _get(gw, context, token, "sbx-a", session)
    assert resumed.reused and head.startswith(b"HTTP/1.1 407"), head
    refused = gw.audit.wait_for(lambda r: r.get("error") == "token_revoked")
    assert refused and {r["sandbox"] for r in refused} == {"sbx-a"}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_openssl_s_client_resumes_through_the_proxy(gw: GatewayThread,
                                                    tmp_path: Path) -> None:
    """`openssl s_client -proxy … -sess_out`, then `-sess_in`: "Reused" the second time."""
    token = gw.mint("agent", "sbx-a")
    sess = tmp_path / "session.pem"

    def s_client(*args: str) -> str:
        out = subprocess.run(
            ["openssl", "s_client", "-proxy", gw.proxy.removeprefix("http://"),
             "-proxy_user", "sbx-a", "-proxy_pass", f"pass:{token}", "-connect", "other.test:443",
             "-servername", "other.test", "-CAfile", str(gw.ca_cert), "-verify_return_error",
             "-ign_eof", *args],
            input=b"GET / HTTP/1.1\r\nHost: other.test\r\nConnection: close\r\n\r\n",
            capture_output=True, timeout=20)
        return out.stdout.decode("latin-1")

    first = s_client("-sess_out", str(sess))
    assert "HTTP/1.1 200 OK" in first and "\nNew, TLSv1.3" in first
    again = s_client("-sess_in", str(sess))
    assert "HTTP/1.1 200 OK" in again and "\nReused, TLSv1.3" in again
