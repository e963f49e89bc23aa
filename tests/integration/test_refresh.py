"""Token refresh for long runs, through the gateway at http://sandbox-gateway.internal."""

from __future__ import annotations

import ssl
import time

import httpx
from helpers.errors import code_of, reason_of
from helpers.gateway import GatewayFactory, GatewayThread

POLICY = """
version: v1
name: agent
egress:
  - host: other.test
    inspect: true
  - host: sandbox-gateway.internal
    methods: [POST]
    paths: ["/v1/tokens/refresh"]
"""
NO_REFRESH = "version: v1\nname: locked\negress:\n  - host: other.test\n    inspect: true\n"
URL = "http://sandbox-gateway.internal/v1/tokens/refresh"


def refresh(gw: GatewayThread, token: str) -> httpx.Response:
    with httpx.Client(proxy=gw.proxy_url(token), timeout=10) as c:
        return c.post(URL)


def test_refresh_keeps_identity_and_lifetime_bound(make_gateway: GatewayFactory) -> None:
    gw = make_gateway({"agent.yaml": POLICY, "locked.yaml": NO_REFRESH})
    tokens = gw.gateway.tokens
    first = tokens.mint("sandbox-1", "agent", {"x": None}, ttl=60, lifetime=120)
    r = refresh(gw, first.token)
    assert r.status_code == 200, r.text
    fresh = r.json()
    assert set(fresh) == {"token", "jti", "expires_at"} and fresh["jti"] != first.jti
    a, b = tokens.verify(first.token), tokens.verify(fresh["token"])
    assert (b.sandbox, b.policy, dict(b.scope)) == (a.sandbox, a.policy, dict(a.scope))
    assert b.lifetime_end == a.lifetime_end and b.expires_at <= a.lifetime_end
    assert b.family == first.jti
    # The refreshed token works through the proxy.
    with httpx.Client(proxy=gw.proxy_url(fresh["token"]), timeout=10,
                      verify=ssl.create_default_context(cafile=gw.ca_cert)) as c:
        assert c.get("https://other.test/ok").status_code == 200
    # Refresh can never outlive the lifetime set at mint.
    short = tokens.mint("sandbox-1", "agent", {}, ttl=60, lifetime=61)
    again = refresh(gw, short.token).json()
    assert again["expires_at"] <= time.time() + 62


def test_revocation_stops_the_whole_chain(make_gateway: GatewayFactory) -> None:
    gw = make_gateway({"agent.yaml": POLICY})
    first = gw.gateway.tokens.mint("sandbox-1", "agent", {})
    fresh = refresh(gw, first.token).json()
    admin = {"Authorization": f"Bearer {gw.gateway.admin_token}"}
    assert httpx.post(f"{gw.admin}/v1/tokens/revoke", json={"jti": first.jti},
                      headers=admin).status_code == 200
    r = refresh(gw, fresh["token"])
    assert r.status_code == 407 and code_of(r.json()) == "token_revoked"
    assert refresh(gw, first.token).status_code == 407


def test_policy_must_allow_refresh(make_gateway: GatewayFactory) -> None:
    gw = make_gateway({"locked.yaml": NO_REFRESH})
    token = gw.mint("locked")
    r = refresh(gw, token)
    assert r.status_code == 403 and code_of(r.json()) == "policy_denied"
    assert "sandbox-gateway.internal" in reason_of(r.json())
