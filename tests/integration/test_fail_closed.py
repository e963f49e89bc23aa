"""Fail closed: an exception in any enforcing hook refuses; nothing reaches upstream.

mitmproxy logs and swallows hook exceptions (a crash in http_connect would answer
200, in requestheaders forward the request, in server_connect dial anyway), so each
hook is wrapped; these tests force a crash in each and prove the refusal.
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import GatewayFactory
from helpers.clients import raw_connect
from helpers.gateway import GatewayThread
from helpers.tls import LocalCA
from helpers.upstream import Upstream

POLICY = """
version: v1
name: agent
egress:
  - host: allowed.test
  - host: other.test
    inspect: true
  - host: api.openai.com
    credential: openai
credentials:
  openai: {preset: openai, secret: openai-api-key}
"""


def boom(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("forced failure")


@pytest.fixture(params=["fast", "mitmproxy"])
def gw(make_gateway: GatewayFactory, tmp_path: Path, request: pytest.FixtureRequest
       ) -> GatewayThread:
    """Both intercept paths: gateway.intercept (HTTP/1.1) and mitmproxy's layers."""
    secrets = tmp_path / "s.yaml"
    secrets.write_text("openai-api-key: sk-fail-closed-key-0123456789\n")
    secrets.chmod(0o600)
    return make_gateway({"agent.yaml": POLICY},
                        config={"secrets": {"store": "file", "path": str(secrets)},
                                "network": {"intercept": request.param}})


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="sandbox_gateway")


def _client(gw: GatewayThread, token: str) -> httpx.Client:
    return httpx.Client(proxy=gw.proxy_url(token), timeout=10,
                        verify=ssl.create_default_context(cafile=gw.ca_cert))


@pytest.mark.parametrize("targets", [
    # The fast path hands a CONNECT it cannot decide to mitmproxy, whose hook then fails.
    ["gateway.tokens.TokenService.verify"],                       # Identify.http_connect
    ["gateway.addons.enforce.decide", "gateway.fastpath.decide"],  # Enforce.http_connect
    ["gateway.resolver.DestinationGuard.check"],                   # Destinations.http_connect
])
def test_crash_at_connect_refuses_the_tunnel(gw: GatewayThread, upstream: Upstream,
                                             monkeypatch: pytest.MonkeyPatch,
                                             targets: list[str]) -> None:
    token = gw.mint("agent")
    for target in targets:
        monkeypatch.setattr(target, boom)
    before = upstream.connections
    assert gw.gateway.proxy_address
    status, headers, body = raw_connect(gw.gateway.proxy_address, "other.test:443", token)
    assert status == 500 and body is not None and body["error"] == "gateway_error"
    assert headers["x-sandbox-gateway-error"] == "gateway_error"
    assert upstream.connections == before


@pytest.mark.parametrize("target", [
    "gateway.addons.enforce.Enforce._authority_mismatch",  # Enforce.requestheaders
    "gateway.addons.inject.request_blob",                   # Inject.requestheaders
])
def test_crash_on_a_request_refuses_it(gw: GatewayThread, upstream: Upstream,
                                       monkeypatch: pytest.MonkeyPatch, target: str) -> None:
    token = gw.mint("agent")
    with _client(gw, token) as c:
        assert c.get("https://other.test/first").status_code == 200
        before = len(upstream.requests)
        monkeypatch.setattr(target, boom)
        r = c.get("https://other.test/second")
    assert r.status_code == 500 and r.json()["error"] == "gateway_error"
    assert len(upstream.requests) == before


def test_crash_in_identify_inside_tunnel(gw: GatewayThread, upstream: Upstream,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    token = gw.mint("agent")
    with _client(gw, token) as c:
        assert c.get("https://other.test/first").status_code == 200
        before = len(upstream.requests)
        # Identify.requestheaders re-verifies the tunnel's token on every request.
        monkeypatch.setattr("gateway.tokens.TokenService.verify", boom)
        r = c.get("https://other.test/second")
    assert r.status_code == 500
    assert len(upstream.requests) == before


def test_crash_in_server_connect_does_not_dial(gw: GatewayThread, upstream: Upstream,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    token = gw.mint("agent")
    monkeypatch.setattr("gateway.addons.destination.pin", boom)  # mitmproxy's server_connect
    monkeypatch.setattr("gateway.intercept.pin", boom)  # the HTTP/1 intercept path's dial
    before = upstream.connections
    with _client(gw, token) as c:
        r = c.get("https://other.test/x")
    assert r.status_code == 403 and r.json()["error"] == "forbidden_destination"
    assert "gateway error" in r.json()["reason"]
    assert upstream.connections == before


def test_crash_choosing_the_layer_closes_the_tunnel(gw: GatewayThread, upstream: Upstream,
                                                    test_ca: LocalCA,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    token = gw.mint("agent")
    # Passthrough tunnels are spliced by the fast path, which checks the first bytes.
    monkeypatch.setattr("gateway.fastpath.starts_like_tls_record", boom)
    before = upstream.connections
    with httpx.Client(proxy=gw.proxy_url(token), timeout=5,
                      verify=ssl.create_default_context(cafile=test_ca.cert_path)) as c, \
            pytest.raises(httpx.HTTPError):
        c.get("https://allowed.test/x")  # passthrough host
    assert upstream.connections == before


def test_crash_in_response_redaction_cuts_the_response(gw: GatewayThread, upstream: Upstream,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    token = gw.mint("agent")
    monkeypatch.setattr("gateway.addons.inject.Redactor", boom)
    with _client(gw, token) as c, pytest.raises(httpx.HTTPError):
        r = c.get("https://api.openai.com/echo-header/Authorization",
                  headers={"Authorization": f"Bearer {token}"})
        assert "sk-fail-closed-key" not in r.text


def test_fast_path_crash_hands_off_to_the_enforcing_chain(
        gw: GatewayThread, upstream: Upstream, test_ca: LocalCA,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The passthrough fast path only ever shortcuts the happy case: if its decision
    crashes, the connection goes to mitmproxy, whose hooks decide (and fail closed)."""
    token = gw.mint("agent")
    monkeypatch.setattr("gateway.fastpath.decide", boom)
    ctx = ssl.create_default_context(cafile=test_ca.cert_path)
    with httpx.Client(proxy=gw.proxy_url(token), timeout=5, verify=ctx) as c:
        assert c.get("https://allowed.test/still-works").status_code == 200
    monkeypatch.setattr("gateway.addons.enforce.decide", boom)
    assert gw.gateway.proxy_address
    status, _, body = raw_connect(gw.gateway.proxy_address, "allowed.test:443", token)
    assert status == 500 and body is not None and body["error"] == "gateway_error"
