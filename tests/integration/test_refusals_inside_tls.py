"""Refusals every client shows (issue 23, item 1): with `refusals.inside_tls` (the default),
a refused CONNECT is answered 200, the gateway completes TLS with its own leaf for the
name and answers the first request with the refusal - so curl, requests, the OpenAI SDK
and git print the reason where a CONNECT-level 403 reads as a connection error. Nothing
is dialled upstream, and the refusal's one audit line is the CONNECT's.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import ssl
import subprocess
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import requests
from helpers.gateway import GatewayFactory, GatewayThread
from helpers.upstream import Upstream

INSIDE = {"refusals": {"inside_tls": True}}


@pytest.fixture
def gw(make_gateway: GatewayFactory) -> GatewayThread:
    return make_gateway(config=INSIDE)


def _lines(gw: GatewayThread, host: str) -> list[dict[str, Any]]:
    gw.settle()  # (the connections ended: a second line, if any, is written by now)
    return [r for r in gw.audit.records() if r["host"] == host]


def _expired_token(gw: GatewayThread) -> str:
    """A token that expired a minute ago (minted by a clock an hour back, for 60 s):
    what an agent that outlived its token holds, without waiting for one to expire."""
    service = gw.gateway.tokens
    real = service.clock
    service.clock = lambda: real() - 3600
    try:
        return gw.mint("agent", ttl=60)
    finally:
        service.clock = real


def test_curl_prints_the_reason(gw: GatewayThread, upstream: Upstream) -> None:
    seen_before = len(upstream.requests)
    out = subprocess.run(
        ["curl", "-sS", "--max-time", "10", "-x", gw.proxy_url(gw.mint("agent")),
         "--cacert", str(gw.ca_cert), "-w", "\n%{http_code}", "https://evil.test/x"],
        capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr  # an HTTP answer, not a proxy error
    body, _, status = out.stdout.rpartition("\n")
    assert status == "403"
    doc = json.loads(body)
    assert doc["error"] == "policy_denied" and "evil.test" in doc["reason"]
    lines = _lines(gw, "evil.test")
    assert [(r["method"], r["decision"], r["error"]) for r in lines] == [
        ("CONNECT", "deny", "policy_denied")]
    assert len(upstream.requests) == seen_before  # never an upstream connection


def test_requests_shows_the_reason(gw: GatewayThread) -> None:
    token = gw.mint("agent")
    r = requests.get("https://evil.test/", proxies={"https": gw.proxy_url(token)},
                     verify=str(gw.ca_cert), timeout=10)
    assert r.status_code == 403 and r.json()["error"] == "policy_denied"
    assert r.headers["x-sandbox-gateway-error"] == "policy_denied"
    assert "proxy-status" in r.headers


OPENAI_POLICY = """
version: v1
name: agent
egress:
  - host: api.openai.com
    credential: openai
credentials:
  openai: {preset: openai, secret: openai-key}
"""


def test_the_openai_sdk_shows_an_expired_token(make_gateway: GatewayFactory) -> None:
    """An agent that read its key once and outlived the token: the SDK's error says the
    token expired (the provider's error shape on its host), not `Connection error.`"""
    gw = make_gateway(policies={"agent.yaml": OPENAI_POLICY}, config=INSIDE)
    token = _expired_token(gw)
    http = httpx.Client(proxy=gw.proxy_url(token),
                        verify=ssl.create_default_context(cafile=str(gw.ca_cert)))
    client = openai.OpenAI(api_key=token, max_retries=0, http_client=http)
    with pytest.raises(openai.APIStatusError) as caught:
        client.models.list()
    assert caught.value.status_code == 407
    assert "token_expired" in caught.value.message and "expired" in caught.value.message
    http.close()
    lines = _lines(gw, "api.openai.com")
    assert [(r["method"], r["error"]) for r in lines] == [("CONNECT", "token_expired")]


def test_an_expired_token_says_so_inside_tls(gw: GatewayThread) -> None:
    """An agent whose token expired reads why, instead of retrying a dead proxy."""
    token = _expired_token(gw)
    r = requests.get("https://allowed.test/", proxies={"https": gw.proxy_url(token)},
                     verify=str(gw.ca_cert), timeout=10)
    assert r.status_code == 407 and r.json()["error"] == "token_expired"
    assert "expired" in r.json()["reason"]


def test_git_prints_the_reason(gw: GatewayThread, tmp_path: Path) -> None:
    """git shows an error body only when it is text/plain (as `remote:` lines)."""
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "HOME": str(tmp_path),
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_SSL_CAINFO": str(gw.ca_cert)}  # (as `env` sets)
    out = subprocess.run(
        ["git", "-c", f"http.proxy={gw.proxy_url(gw.mint('agent'))}", "clone",
         "https://evil.test/org/repo.git", str(tmp_path / "repo")],
        capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode != 0
    assert "remote: sandbox-gateway refused this request: policy_denied" in out.stderr, \
        out.stderr
    assert "evil.test" in out.stderr


def test_a_missing_token_is_still_a_407_challenge_at_the_connect(gw: GatewayThread) -> None:
    """Clients send proxy credentials only when challenged (the JVM's authenticator):
    a CONNECT without any is answered 407 at the CONNECT."""
    assert gw.gateway.proxy_address
    with socket.create_connection(gw.gateway.proxy_address, timeout=10) as sock:
        sock.sendall(b"CONNECT evil.test:443 HTTP/1.1\r\nHost: evil.test:443\r\n\r\n")
        head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 407 ") and b"Proxy-Authenticate: Basic" in head


def test_what_is_not_a_request_inside_just_closes(gw: GatewayThread) -> None:
    """No TLS, or TLS and then no HTTP/1: the connection closes, no second line."""
    assert gw.gateway.proxy_address
    cred = base64.b64encode(f"sandbox-1:{gw.mint('agent')}".encode()).decode()
    connect = (f"CONNECT evil.test:443 HTTP/1.1\r\nHost: evil.test:443\r\n"
               f"Proxy-Authorization: Basic {cred}\r\n\r\n").encode()
    with socket.create_connection(gw.gateway.proxy_address, timeout=10) as sock:
        sock.sendall(connect)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"not TLS at all\r\n\r\n")
        while sock.recv(65536):  # (a TLS alert, perhaps, then the end: no HTTP answer)
            pass
    ctx = ssl.create_default_context(cafile=str(gw.ca_cert))
    with socket.create_connection(gw.gateway.proxy_address, timeout=10) as raw:
        raw.sendall(connect)
        assert raw.recv(65536).startswith(b"HTTP/1.1 200 ")
        with ctx.wrap_socket(raw, server_hostname="evil.test") as tls:
            tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            assert tls.recv(65536) == b""
    assert [r["error"] for r in _lines(gw, "evil.test")] == ["policy_denied"] * 2


def test_off_restores_refusals_at_the_connect(make_gateway: GatewayFactory) -> None:
    gw = make_gateway(config={"refusals": {"inside_tls": False}})
    out = subprocess.run(
        ["curl", "-sS", "--max-time", "10", "-x", gw.proxy_url(gw.mint("agent")),
         "--cacert", str(gw.ca_cert), "https://evil.test/x"],
        capture_output=True, text=True, timeout=20)
    assert out.returncode != 0 and "403" in out.stderr
