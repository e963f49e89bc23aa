"""Audit lines of token refusals: a token whose signature verifies and that is refused for
time (expired, not yet valid) or revocation names its sandbox, policy and jti; a forged
or unsigned token names nobody (its claims are never believed). Through the real
gateway: CONNECT, plain proxy requests and the credential carrier, on both intercept
engines."""

from __future__ import annotations

import base64
import json
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from helpers.clients import raw_connect, read_head
from helpers.errors import code_of
from helpers.gateway import GatewayFactory, GatewayThread

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
SANDBOX = "sandbox-1"


@pytest.fixture(params=["fast", "mitmproxy"])
def gw(make_gateway: GatewayFactory, tmp_path: Path,
       request: pytest.FixtureRequest) -> GatewayThread:
    secrets = tmp_path / "secrets.yaml"
    secrets.write_text("openai-api-key: sk-audit-test-key-0123456789\n")
    secrets.chmod(0o600)
    return make_gateway({"agent.yaml": POLICY}, config={
        "secrets": {"store": "file", "path": str(secrets)},
        "network": {"intercept": request.param}})


def _shifted(gw: GatewayThread, seconds: float) -> tuple[str, str]:
    """A token minted by a clock `seconds` off (negative: now expired)."""
    service = gw.gateway.tokens
    real = service.clock
    service.clock = lambda: real() + seconds
    try:
        minted = service.mint(SANDBOX, "agent", ttl=60)
    finally:
        service.clock = real
    return minted.token, minted.jti


def _expired(gw: GatewayThread) -> tuple[str, str]:
    return _shifted(gw, -3600)


def _not_yet_valid(gw: GatewayThread) -> tuple[str, str]:
    return _shifted(gw, 3600)


def _revoked(gw: GatewayThread) -> tuple[str, str]:
    minted = gw.gateway.tokens.mint(SANDBOX, "agent")
    gw.call(gw.gateway.state.revoke(minted.jti, 1e12))
    return minted.token, minted.jti


def _claims(gw: GatewayThread, jti: str) -> dict[str, Any]:
    real = jwt.decode(gw.mint("agent"), options={"verify_signature": False})
    return {**real, "jti": jti, "exp": int(real["iat"]) - 60}  # and expired


def _forged(gw: GatewayThread) -> tuple[str, str]:
    """The gateway's kid and plausible claims, signed by another key."""
    kid = gw.gateway.tokens.keys.signing_kid
    token = jwt.encode(_claims(gw, "forged-jti"), Ed25519PrivateKey.generate(),
                       algorithm="EdDSA", headers={"kid": kid})
    return token, "forged-jti"


def _unsigned(gw: GatewayThread) -> tuple[str, str]:
    def part(doc: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).rstrip(b"=").decode()
    header = {"alg": "none", "kid": gw.gateway.tokens.keys.signing_kid}
    return f"{part(header)}.{part(_claims(gw, 'unsigned-jti'))}.", "unsigned-jti"


TOKENS: list[tuple[str, Callable[[GatewayThread], tuple[str, str]], str, bool]] = [
    # (id, make (token, jti), refusal code, is its identity on the audit line)
    ("expired", _expired, "token_expired", True),
    ("not-yet-valid", _not_yet_valid, "token_not_yet_valid", True),
    ("revoked", _revoked, "token_revoked", True),
    ("forged", _forged, "token_bad_signature", False),
    ("unsigned", _unsigned, "token_bad_algorithm", False),
]
CASES = [pytest.param(*row[1:], id=row[0]) for row in TOKENS]


def _deny_line(gw: GatewayThread, code: str) -> dict[str, Any]:
    lines = gw.audit.wait_for(lambda r: r["error"] == code)
    assert len(lines) == 1, gw.audit.records()
    return lines[0]


def _check(line: dict[str, Any], jti: str, named: bool) -> None:
    if named:
        assert (line["sandbox"], line["policy"], line["jti"]) == (SANDBOX, "agent", jti), line
    else:
        assert (line["sandbox"], line["policy"], line["jti"]) == (None, None, None), line


@pytest.mark.parametrize(("make", "code", "named"), CASES)
def test_connect(gw: GatewayThread, make: Callable[[GatewayThread], tuple[str, str]],
                 code: str, named: bool) -> None:
    token, jti = make(gw)
    assert gw.gateway.proxy_address is not None
    status, _, body = raw_connect(gw.gateway.proxy_address, "other.test:443", token)
    assert status == 407 and body is not None and body["error"] == code
    line = _deny_line(gw, code)
    assert line["method"] == "CONNECT" and line["status"] == 407
    _check(line, jti, named)


@pytest.mark.parametrize(("make", "code", "named"), CASES)
def test_plain_proxy_request(gw: GatewayThread,
                             make: Callable[[GatewayThread], tuple[str, str]],
                             code: str, named: bool) -> None:
    token, jti = make(gw)
    cred = base64.b64encode(f"{SANDBOX}:{token}".encode()).decode()
    assert gw.gateway.proxy_address is not None
    with socket.create_connection(gw.gateway.proxy_address, timeout=10) as sock:
        sock.sendall(b"GET http://other.test/x HTTP/1.1\r\nHost: other.test\r\n"
                     b"Proxy-Authorization: Basic " + cred.encode() + b"\r\n\r\n")
        head = read_head(sock, 65536)
    assert head.split(b" ", 2)[1] == b"407", head
    line = _deny_line(gw, code)
    assert line["method"] == "GET" and line["status"] == 407
    _check(line, jti, named)


@pytest.mark.parametrize(("make", "code", "named"), CASES)
def test_credential_carrier(gw: GatewayThread,
                            make: Callable[[GatewayThread], tuple[str, str]],
                            code: str, named: bool) -> None:
    """A live proxy token, and the refused token where the provider expects its key: a
    verified token of this sandbox names itself (its own jti); otherwise the line
    names the connection's token, never the refused token's claims."""
    live = gw.gateway.tokens.mint(SANDBOX, "agent")
    token, jti = make(gw)
    verify = ssl.create_default_context(cafile=gw.ca_cert)
    with httpx.Client(proxy=gw.proxy_url(live.token), verify=verify, timeout=10) as c:
        r = c.post("https://api.openai.com/v1/chat/completions", json={},
                   headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 407 and code_of(r.json()) == code, r.text
    line = _deny_line(gw, code)
    assert line["host"] == "api.openai.com" and line["status"] == 407
    _check(line, jti if named else live.jti, True)
