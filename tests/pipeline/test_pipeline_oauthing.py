"""A rule with `mcp.oauth` through the gate built from fakes: the sandbox's own token
refused before the port is asked, the grant's token attached (and named on the audit
line, never shown), a consent held for when there is none, the audience check, the
server's 401 and `insufficient_scope` read in the answer, the token a leak marker on
every other host. The port (`McpTokens`) is a fake that records what it is asked."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.core.addresses import Pinned
from gateway.core.client import Client
from gateway.core.identity import Identity, TokenRefused
from gateway.core.mcp_oauth import Challenge, McpToken
from gateway.core.messages import Headers, RequestHead, ResponseHead
from gateway.core.policy.ask_rule import Ask
from gateway.core.policy.mcp_rule import McpOAuth
from gateway.core.refusal import Answer, Refusal
from gateway.core.secret_value import MintedValue, SecretValue
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.gate import Gate
from gateway.services.policy import load_policy_texts

POLICY = """
version: v1
name: agent
egress:
  - host: mcp.test
    mcp:
      tools: {allow: ["*"]}
      oauth: {scopes: [mcp]}
  - host: elsewhere.test
    inspect: true
"""
TOKEN = "gateway-held-access-token-0123456789"
GOOD = "sgw1.good.sig"


class Tokens:
    issuer = "sandbox-gateway"

    def verify(self, token: str) -> Identity:
        if token != GOOD:
            raise TokenRefused("token_malformed", "not a gateway token")
        now = time.time()
        return Identity(sandbox="sandbox-1", policy="agent", jti="j", scope={},
                        issued_at=now, expires_at=now + 900, lifetime_end=now + 3600)

    def refresh(self, identity: Identity, ttl: float | None = None) -> Any:
        raise NotImplementedError


class Guard:
    async def check(self, host: str, port: int) -> Pinned:
        return Pinned(host, port, "203.0.113.7")


class Secrets:
    async def get(self, name: str) -> SecretValue:
        raise LookupError(name)

    def invalidate(self, name: str, rejected: SecretValue | None = None) -> None:
        return None

    def known_items(self) -> list[tuple[str, SecretValue]]:
        return []


class Registry:
    def sandbox_for(self, ip: str) -> None:
        return None


@dataclass
class Port:
    """The McpTokens port: `grant` held from the start or once `consent` ran."""

    granted: bool = True
    resource: str = "https://mcp.test/mcp"
    consent_refusal: Refusal | None = None
    asked: list[str] = field(default_factory=list)
    rejected_with: list[Challenge | None] = field(default_factory=list)
    version: int = 0

    def _token(self) -> McpToken:
        return McpToken("og_1", "sandbox:sandbox-1", self.resource, ("mcp",),
                        MintedValue(TOKEN))

    def live(self) -> list[tuple[str, SecretValue]]:
        return [("mcp.test", self._token().value)] if self.granted else []

    async def token(self, identity: Identity, resource: str, oauth: McpOAuth
                    ) -> McpToken | None:
        self.asked.append(f"token {resource} {oauth.scopes}")
        return self._token() if self.granted else None

    async def consent(self, identity: Identity, resource: str, oauth: McpOAuth, spec: Ask,
                      rule: str | None) -> None:
        self.asked.append(f"consent {resource} {spec.timeout:g}")
        if self.consent_refusal is not None:
            raise self.consent_refusal
        self.granted = True
        self.version += 1

    def rejected(self, token: McpToken, resource: str, challenge: Challenge | None) -> None:
        self.rejected_with.append(challenge)


def _begin(port: Port, host: str = "mcp.test", *headers: tuple[str, str],
           path: str = "/mcp") -> tuple[Exchange | Answer, list[dict[str, Any]]]:
    lines: list[dict[str, Any]] = []
    policies = load_policy_texts({"policies/agent.yaml": POLICY})
    gate = Gate(tokens=Tokens(), policies=lambda: policies, guard=Guard(),
                secrets=Secrets(), registry=Registry(), audit=lines.append,
                mcp_tokens=port)  # type: ignore[arg-type]

    async def run() -> Exchange | Answer:
        client = Client(("10.0.0.5", 40000))
        await gate.connect(client, f"{host}:443", f"Bearer {GOOD}")
        head = RequestHead("POST", path, Headers.of(("Host", host), *headers))
        return await gate.begin(client, head, tls=True)
    return asyncio.run(run()), lines


def _refused(got: Exchange | Answer, code: str) -> Answer:
    assert isinstance(got, Answer), got
    assert json.loads(got.body)["error"] == code, got.body
    return got


def test_the_grants_token_is_attached_and_named_not_shown() -> None:
    port = Port()
    ex, lines = _begin(port)
    assert isinstance(ex, Exchange)
    assert ex.head.headers.get("authorization") == f"Bearer {TOKEN}"
    assert port.asked == ["token https://mcp.test/mcp ('mcp',)"]
    ex.finish(200)
    assert lines[-1]["credential"] == "mcp-oauth:og_1 (sandbox:sandbox-1)"
    assert TOKEN not in json.dumps(lines)


def test_a_token_the_sandbox_sends_is_refused_before_the_port_is_asked() -> None:
    port = Port()
    got, lines = _begin(port, "mcp.test", ("Authorization", "Bearer sandbox-own"))
    answer = _refused(got, "mcp_token_refused")
    assert answer.status == 403 and port.asked == []
    assert lines[-1]["error"] == "mcp_token_refused" and "sandbox-own" not in \
        json.dumps(lines)


def test_without_a_grant_the_request_waits_for_consent() -> None:
    port = Port(granted=False)
    ex, _ = _begin(port)
    assert isinstance(ex, Exchange)
    assert port.asked == ["token https://mcp.test/mcp ('mcp',)",
                          "consent https://mcp.test/mcp 300",
                          "token https://mcp.test/mcp ('mcp',)"]
    assert ex.head.headers.get("authorization") == f"Bearer {TOKEN}"


def test_a_declined_consent_is_the_answer() -> None:
    port = Port(granted=False, consent_refusal=Refusal("approval_denied", "no", "ap_1"))
    got, _ = _begin(port)
    _refused(got, "approval_denied")


def test_a_token_for_another_resource_is_not_sent() -> None:
    got, _ = _begin(Port(resource="https://other.test/mcp"))
    answer = _refused(got, "mcp_oauth_failed")
    assert TOKEN.encode() not in answer.body


def test_without_the_port_the_rule_fails_closed() -> None:
    got, _ = _begin(None)  # type: ignore[arg-type]
    _refused(got, "mcp_oauth_failed")


@pytest.mark.parametrize(("status", "challenge", "refused"), [
    (401, 'Bearer error="invalid_token"', True),
    (401, None, True),
    (403, 'Bearer error="insufficient_scope", scope="mcp admin"', True),
    (403, 'Bearer error="invalid_request"', False),  # (the server's own 403: relayed)
    (403, None, False),
    (200, None, False),
])
def test_the_servers_refusal_of_the_token_is_read(status: int, challenge: str | None,
                                                   refused: bool) -> None:
    port = Port()
    ex, _ = _begin(port)
    assert isinstance(ex, Exchange)
    fields = [("Content-Type", "application/json")]
    if challenge is not None:
        fields.append(("WWW-Authenticate", challenge))
    head = ResponseHead(status, "x", Headers.of(*fields), "HTTP/1.1")
    if not refused:
        assert ex.response(head).status == status and port.rejected_with == []
        return
    with pytest.raises(Refusal) as caught:
        ex.response(head)
    assert caught.value.code == "mcp_consent_required" and caught.value.retry_after == 5
    assert len(port.rejected_with) == 1
    if status == 403:
        assert port.rejected_with[0] == Challenge("insufficient_scope", ("mcp", "admin"))
        assert "more scopes" in caught.value.reason


def test_the_token_is_a_leak_marker_on_every_other_host() -> None:
    got, _ = _begin(Port(), "elsewhere.test", ("X-Stolen", TOKEN), path="/up")
    _refused(got, "exfiltration_blocked")
    mine, _ = _begin(Port(), "mcp.test")  # (on its own server it is the credential)
    assert isinstance(mine, Exchange)
