"""Audit lines of token refusals: a token whose signature verifies and that is refused for
time (expired, not yet valid) or revocation names its sandbox, policy and jti; a forged
or unsigned token names nobody (its claims are never believed). Through the real
gateway: CONNECT, plain proxy requests and the credential carrier, on both intercept
engines. One gateway per engine for the module: each test its own sandbox, and only the
audit lines written after it started."""

from __future__ import annotations

import base64
import json
import re
import socket
import ssl
import time
from collections.abc import Callable
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
@pytest.fixture(scope="module", params=["fast", "mitmproxy"])
def engine(make_module_gateway: GatewayFactory, tmp_path_factory: pytest.TempPathFactory,
           request: pytest.FixtureRequest) -> GatewayThread:
    secrets = tmp_path_factory.mktemp("secrets") / "secrets.yaml"
    secrets.write_text("openai-api-key: sk-audit-test-key-0123456789\n")
    secrets.chmod(0o600)
    return make_module_gateway({"agent.yaml": POLICY}, config={
        "secrets": {"store": "file", "path": str(secrets)},
        "network": {"intercept": request.param}})


class Gw:
    """The module's gateway for one test: its sandbox, the audit lines since it began."""

    def __init__(self, gw: GatewayThread, sandbox: str) -> None:
        self.thread, self.gateway, self.sandbox = gw, gw.gateway, sandbox
        self.since = len(gw.audit.records())

    def lines(self) -> list[dict[str, Any]]:
        return self.thread.audit.records()[self.since:]


@pytest.fixture
def gw(engine: GatewayThread, request: pytest.FixtureRequest) -> Gw:
    return Gw(engine, re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-"))


def _shifted(gw: Gw, seconds: float) -> tuple[str, str]:
    """A token minted by a clock `seconds` off (negative: now expired)."""
    service = gw.gateway.tokens
    real = service.clock
    service.clock = lambda: real() + seconds
    try:
        minted = service.mint(gw.sandbox, "agent", ttl=60)
    finally:
        service.clock = real
    return minted.token, minted.jti


def _expired(gw: Gw) -> tuple[str, str]:
    return _shifted(gw, -3600)


def _not_yet_valid(gw: Gw) -> tuple[str, str]:
    return _shifted(gw, 3600)


def _revoked(gw: Gw) -> tuple[str, str]:
    minted = gw.gateway.tokens.mint(gw.sandbox, "agent")
    gw.thread.call(gw.gateway.state.revoke(minted.jti, 1e12))
    return minted.token, minted.jti


def _claims(gw: Gw, jti: str) -> dict[str, Any]:
    real = jwt.decode(gw.thread.mint("agent", gw.sandbox), options={"verify_signature": False})
    return {**real, "jti": jti, "exp": int(real["iat"]) - 60}  # and expired


def _forged(gw: Gw) -> tuple[str, str]:
    """The gateway's kid and plausible claims, signed by another key."""
    kid = gw.gateway.tokens.keys.signing_kid
    token = jwt.encode(_claims(gw, "forged-jti"), Ed25519PrivateKey.generate(),
                       algorithm="EdDSA", headers={"kid": kid})
    return token, "forged-jti"


def _unsigned(gw: Gw) -> tuple[str, str]:
    def part(doc: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).rstrip(b"=").decode()
    header = {"alg": "none", "kid": gw.gateway.tokens.keys.signing_kid}
    return f"{part(header)}.{part(_claims(gw, 'unsigned-jti'))}.", "unsigned-jti"


TOKENS: list[tuple[str, Callable[[Gw], tuple[str, str]], str, bool]] = [
    # (id, make (token, jti), refusal code, is its identity on the audit line)
    ("expired", _expired, "token_expired", True),
    ("not-yet-valid", _not_yet_valid, "token_not_yet_valid", True),
    ("revoked", _revoked, "token_revoked", True),
    ("forged", _forged, "token_bad_signature", False),
    ("unsigned", _unsigned, "token_bad_algorithm", False),
]
CASES = [pytest.param(*row[1:], id=row[0]) for row in TOKENS]


def _deny_line(gw: Gw, code: str) -> dict[str, Any]:
    """This test's one refusal line (written a moment after the client saw the answer)."""
    deadline = time.monotonic() + 3
    while not (lines := [r for r in gw.lines() if r["error"] == code]):
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert len(lines) == 1, gw.lines()
    return lines[0]


def _check(gw: Gw, line: dict[str, Any], jti: str, named: bool) -> None:
    if named:
        assert (line["sandbox"], line["policy"], line["jti"]) == (gw.sandbox, "agent", jti), \
            line
    else:
        assert (line["sandbox"], line["policy"], line["jti"]) == (None, None, None), line


@pytest.mark.parametrize(("make", "code", "named"), CASES)
def test_connect(gw: Gw, make: Callable[[Gw], tuple[str, str]],
                 code: str, named: bool) -> None:
    token, jti = make(gw)
    assert gw.gateway.proxy_address is not None
    status, _, body = raw_connect(gw.gateway.proxy_address, "other.test:443", token,
                                  gw.sandbox)
    assert status == 407 and body is not None and body["error"] == code
    line = _deny_line(gw, code)
    assert line["method"] == "CONNECT" and line["status"] == 407
    _check(gw, line, jti, named)


@pytest.mark.parametrize(("make", "code", "named"), CASES)
def test_plain_proxy_request(gw: Gw,
                             make: Callable[[Gw], tuple[str, str]],
                             code: str, named: bool) -> None:
    token, jti = make(gw)
    cred = base64.b64encode(f"{gw.sandbox}:{token}".encode()).decode()
    assert gw.gateway.proxy_address is not None
    with socket.create_connection(gw.gateway.proxy_address, timeout=10) as sock:
        sock.sendall(b"GET http://other.test/x HTTP/1.1\r\nHost: other.test\r\n"
                     b"Proxy-Authorization: Basic " + cred.encode() + b"\r\n\r\n")
        head = read_head(sock, 65536)
    assert head.split(b" ", 2)[1] == b"407", head
    line = _deny_line(gw, code)
    assert line["method"] == "GET" and line["status"] == 407
    _check(gw, line, jti, named)


@pytest.mark.parametrize(("make", "code", "named"), CASES)
def test_credential_carrier(gw: Gw,
                            make: Callable[[Gw], tuple[str, str]],
                            code: str, named: bool) -> None:
    """A live proxy token, and the refused token where the provider expects its key: a
    verified token of this sandbox names itself (its own jti); otherwise the line
    names the connection's token, never the refused token's claims."""
    live = gw.gateway.tokens.mint(gw.sandbox, "agent")
    token, jti = make(gw)
    verify = ssl.create_default_context(cafile=gw.thread.ca_cert)
    proxy = gw.thread.proxy_url(live.token, gw.sandbox)
    with httpx.Client(proxy=proxy, verify=verify, timeout=10) as c:
        r = c.post("https://api.openai.com/v1/chat/completions", json={},
                   headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 407 and code_of(r.json()) == code, r.text
    line = _deny_line(gw, code)
    assert line["host"] == "api.openai.com" and line["status"] == 407
    _check(gw, line, jti if named else live.jti, True)
