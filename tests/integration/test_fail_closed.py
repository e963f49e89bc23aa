"""Fail closed: an exception anywhere in a decision refuses; nothing reaches upstream.

The gate's entry points turn an unexpected error into `500 gateway_error`; each engine
has one boundary of its own (the front door and the HTTP/1 engine close the
connection, the mitmproxy adapter wraps every hook, since mitmproxy logs and swallows
hook exceptions). These tests force a crash in each step, on both engines, and prove
the refusal.
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.clients import raw_connect
from helpers.errors import code_of, reason_of
from helpers.gateway import GatewayFactory, GatewayThread
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
    """Both engines: the gateway's own (front door, HTTP/1 engine) and mitmproxy."""
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


@pytest.mark.parametrize("target", [
    "gateway.services.identity.tokens.TokenService.verify",            # identify
    "gateway.core.evaluate.decide",                   # the policy decision
    "gateway.net.resolver.DestinationGuard.check",    # the destination check
    "gateway.core.target.tunnel_authority",           # the target
])
def test_crash_at_connect_refuses_the_tunnel(gw: GatewayThread, upstream: Upstream,
                                             monkeypatch: pytest.MonkeyPatch,
                                             target: str) -> None:
    token = gw.mint("agent")
    monkeypatch.setattr(target, boom)
    before = upstream.connections
    assert gw.gateway.proxy_address
    status, headers, body = raw_connect(gw.gateway.proxy_address, "other.test:443", token)
    assert status == 500 and body is not None and body["error"] == "gateway_error"
    assert headers["x-sandbox-gateway-error"] == "gateway_error"
    assert upstream.connections == before
    [line] = gw.audit.wait_for(lambda r: r["error"] == "gateway_error")
    assert line["decision"] == "deny" and line["method"] == "CONNECT"


@pytest.mark.parametrize("target", [
    "gateway.core.target.request_target",   # the request's target
    "gateway.core.leaks.LeakScan.head",     # the leak scan of the head
    "gateway.core.evaluate.decide",         # the policy decision
    "gateway.services.identity.tokens.TokenService.verify",  # identity, on every request
])
def test_crash_on_a_request_refuses_it(gw: GatewayThread, upstream: Upstream,
                                       monkeypatch: pytest.MonkeyPatch, target: str) -> None:
    token = gw.mint("agent")
    with _client(gw, token) as c:
        assert c.get("https://other.test/first").status_code == 200
        before = len(upstream.requests)
        monkeypatch.setattr(target, boom)
        r = c.get("https://other.test/second")
    assert r.status_code == 500 and code_of(r.json()) == "gateway_error"
    assert len(upstream.requests) == before


def test_crash_in_a_body_check_refuses_it(gw: GatewayThread, upstream: Upstream,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    token = gw.mint("agent")
    monkeypatch.setattr("gateway.core.leaks.StreamScan.feed", boom)
    before = len(upstream.requests)
    with _client(gw, token) as c:
        try:
            r = c.post("https://other.test/upload", content=b"x" * 1000)
        except httpx.HTTPError:
            pass
        else:
            assert r.status_code == 500 and code_of(r.json()) == "gateway_error"
    assert len(upstream.requests) == before


def test_crash_in_the_dial_check_does_not_dial(gw: GatewayThread, upstream: Upstream,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    token = gw.mint("agent")
    monkeypatch.setattr("gateway.engines.mitm.pin", boom)  # mitmproxy's server_connect
    monkeypatch.setattr("gateway.engines.h1.side.pin", boom)  # the HTTP/1 engine's dial
    before = upstream.connections
    with _client(gw, token) as c:
        r = c.get("https://other.test/x")
    assert r.status_code == 403 and code_of(r.json()) == "forbidden_destination"
    assert "gateway error" in reason_of(r.json())
    assert upstream.connections == before


def test_crash_checking_the_first_bytes_closes_the_tunnel(
        gw: GatewayThread, upstream: Upstream, test_ca: LocalCA,
        monkeypatch: pytest.MonkeyPatch) -> None:
    token = gw.mint("agent")
    monkeypatch.setattr("gateway.core.target.check_server_name", boom)
    before = upstream.connections
    with httpx.Client(proxy=gw.proxy_url(token), timeout=5,
                      verify=ssl.create_default_context(cafile=test_ca.cert_path)) as c, \
            pytest.raises(httpx.HTTPError):
        c.get("https://allowed.test/x")  # passthrough host
    assert upstream.connections == before


def test_crash_in_response_redaction_cuts_the_response(gw: GatewayThread, upstream: Upstream,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    token = gw.mint("agent")
    monkeypatch.setattr("gateway.core.leaks.Redactor.feed", boom)
    with _client(gw, token) as c, pytest.raises(httpx.HTTPError):
        r = c.get("https://api.openai.com/echo-header/Authorization",
                  headers={"Authorization": f"Bearer {token}"})
        assert "sk-fail-closed-key" not in r.text


def test_the_mitmproxy_adapter_has_one_guarded_boundary() -> None:
    """Every hook mitmproxy can call on the adapter goes through the one fail-closed
    wrapper: no hook can be added without it."""
    from mitmproxy import hooks

    from gateway.engines import mitm

    known = set(hooks.all_hooks)
    defined = {name for name in vars(mitm.Adapter) if name in known}
    assert defined == set(mitm.HOOKS)
    # (`configure` is mitmproxy's own NextLayer reading its options, not a decision)
    assert {n for n in dir(mitm.Adapter) if n in known} - defined == {"configure"}
    for name in defined:
        assert getattr(mitm.Adapter, name).__wrapped__ is getattr(mitm.Adapter, f"_on_{name}")
