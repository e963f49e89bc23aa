"""A revoked token's open connections end within a second, on every engine (issue 21).

Each request is checked as it comes; what sends no more requests - a passthrough
tunnel, a keep-alive tunnel between requests, a stream being answered - would live on
after `POST /v1/tokens/revoke` without the gate's sweep. Measured before: all of them
stayed open. A second sandbox's connections, not revoked, stay open.
"""

from __future__ import annotations

import ssl
import time
from typing import Any

import httpx
import pytest
from helpers.clients import ended_within, open_tunnel
from helpers.gateway import GatewayFactory, GatewayThread
from helpers.tls import LocalCA

POLICY = """
version: v1
name: agent
egress:
  - host: allowed.test
  - host: other.test
    inspect: true
"""


def _tunnel(gw: GatewayThread, token: str, sandbox: str, host: str, cafile: str
            ) -> ssl.SSLSocket:
    """CONNECT host:443 and a TLS session in it (read timeout 5 s)."""
    assert gw.gateway.proxy_address is not None
    sock = open_tunnel(gw.gateway.proxy_address, f"{host}:443", token, sandbox, timeout=5)
    return ssl.create_default_context(cafile=cafile).wrap_socket(sock, server_hostname=host)


def _get(tls: ssl.SSLSocket, host: str, path: str) -> bytes:
    """Send a GET; the first bytes of the answer."""
    tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    return tls.recv(65536)


@pytest.mark.parametrize("intercept", ["fast", "mitmproxy"])
def test_revoked_tokens_connections_end_within_a_second(
        make_gateway: GatewayFactory, test_ca: LocalCA, intercept: str) -> None:
    gw = make_gateway({"agent.yaml": POLICY}, config={"network": {"intercept": intercept}})
    admin = gw.gateway.admin_token
    revoked, kept = gw.mint("agent", "sbx-revoked"), gw.mint("agent", "sbx-kept")
    upstream_ca, gateway_ca = str(test_ca.cert_path), str(gw.ca_cert)
    conns: dict[str, Any] = {}
    for name, token, sandbox in (("revoked", revoked, "sbx-revoked"),
                                 ("kept", kept, "sbx-kept")):
        passthrough = _tunnel(gw, token, sandbox, "allowed.test", upstream_ca)  # (idle)
        keepalive = _tunnel(gw, token, sandbox, "other.test", gateway_ca)
        assert _get(keepalive, "other.test", "/").startswith(b"HTTP/1.1 200")
        stream = _tunnel(gw, token, sandbox, "other.test", gateway_ca)
        assert _get(stream, "other.test", "/sse?n=200&interval=0.05").startswith(b"HTTP/1.1 200")
        conns[name] = {"passthrough": passthrough, "keep-alive": keepalive, "stream": stream}
    jti = gw.gateway.tokens.verify(revoked).jti
    answer = httpx.post(f"{gw.admin}/v1/tokens/revoke", json={"jti": jti},
                        headers={"Authorization": f"Bearer {admin}"})
    assert answer.status_code == 200
    took = {kind: ended_within(tls, 1.5) for kind, tls in conns["revoked"].items()}
    for tls in conns["revoked"].values():
        tls.close()
    assert all(t is not None and t < 1.0 for t in took.values()), took
    for kind, tls in conns["kept"].items():
        assert ended_within(tls, 0.3) is None, f"{kind} of the other sandbox was ended"
        tls.close()
    # The lines of what was ended say why.
    def ended() -> list[dict[str, Any]]:
        return [r for r in gw.audit.records() if r.get("sandbox") == "sbx-revoked"
                and r.get("error") == "token_revoked"]

    deadline = time.monotonic() + 3
    while len(ended()) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert any(r.get("path_taken") == "passthrough" for r in ended())
    assert any(r.get("path") == "/sse" or "/sse" in str(r.get("path")) for r in ended())
    # A new request with it is refused as before.
    with pytest.raises(ConnectionRefusedError, match="407"):
        _tunnel(gw, revoked, "sbx-revoked", "allowed.test", upstream_ca)


def test_an_expired_token_ends_passthrough_tunnels_but_lets_a_stream_finish(
        make_gateway: GatewayFactory, test_ca: LocalCA) -> None:
    """Expiry is not revocation: the passthrough tunnel ends (`token_expired`), the
    intercepted stream under way when the token expired is answered to its end."""
    gw = make_gateway({"agent.yaml": POLICY})
    # 2 s, not 1: `exp` is whole seconds, so a 1 s token may have a few ms left when it is
    # used (the request would then be refused before the stream starts).
    minted = gw.gateway.tokens.mint("sbx-exp", "agent", {}, ttl=2)
    passthrough = _tunnel(gw, minted.token, "sbx-exp", "allowed.test", str(test_ca.cert_path))
    stream = _tunnel(gw, minted.token, "sbx-exp", "other.test", str(gw.ca_cert))
    try:
        # Events 0.05 s apart until well past the expiry and the sweep after it.
        events = int((minted.expires_at - time.time() + 1.5) / 0.05) + 1
        assert _get(stream, "other.test", f"/sse?n={events}&interval=0.05").startswith(
            b"HTTP/1.1 200")
        took = ended_within(passthrough, max(0.0, minted.expires_at - time.time()) + 1.0)
        assert took is not None
        stream.settimeout(5)
        body = b""
        while b"0\r\n\r\n" not in body:
            chunk = stream.recv(65536)
            assert chunk, "the stream was cut"
            body += chunk
    finally:
        passthrough.close()
        stream.close()
    assert any(r.get("path_taken") == "passthrough" and r.get("error") == "token_expired"
               for r in gw.audit.records() if r.get("sandbox") == "sbx-exp")
