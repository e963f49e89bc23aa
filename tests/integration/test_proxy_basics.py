"""The foundation, end to end: real gateway, real TLS upstream, real clients."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import subprocess
import time
from typing import Any

import httpx
import pytest
import requests
from helpers.clients import curl as run_curl
from helpers.clients import raw_connect
from helpers.errors import code_of, reason_of
from helpers.gateway import GatewayFactory, GatewayThread
from helpers.upstream import Upstream


def curl(gw: GatewayThread, url: str, token: str | None, *args: str
         ) -> tuple[int, str, dict[str, str]]:
    return run_curl(gw.proxy_url(token) if token else gw.proxy, url, gw.ca_cert, *args)


def connect(gw: GatewayThread, authority: str, token: str | None
            ) -> tuple[int, dict[str, str], dict[str, Any] | None]:
    assert gw.gateway.proxy_address
    return raw_connect(gw.gateway.proxy_address, authority, token)


def client(gw: GatewayThread, token: str | None, **kw: Any) -> httpx.Client:
    proxy = gw.proxy_url(token) if token else gw.proxy
    return httpx.Client(proxy=proxy, verify=ssl.create_default_context(cafile=gw.ca_cert),
                        timeout=10, **kw)


def test_curl_allowed_passthrough_and_refused_host(gateway: GatewayThread, upstream: Upstream,
                                                   test_ca: Any) -> None:
    token = gateway.mint("agent")
    # allowed.test is host-only: passed through, so curl must trust the *upstream's* CA.
    out = subprocess.run(
        ["curl", "-sS", "--max-time", "10", "-x", gateway.proxy_url(token), "--cacert",
         str(test_ca.cert_path), "https://allowed.test/hello"],
        capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["path"] == "/hello"

    status, headers, err = connect(gateway, "evil.test:443", token)
    assert status == 403 and err is not None
    assert err["error"] == "policy_denied"
    assert "evil.test" in err["reason"] and "add" in err["reason"]
    assert headers["x-sandbox-gateway-error"] == "policy_denied"


def test_httpx_intercepted_method_and_path_rules(gateway: GatewayThread,
                                                 upstream: Upstream) -> None:
    token = gateway.mint("agent")
    with client(gateway, token) as c:
        ok = c.get("https://api.allowed.test/v1/models")
        assert ok.status_code == 200, ok.text
        assert ok.json()["path"] == "/v1/models"
        # no Proxy-Authorization leaks upstream
        assert "proxy-authorization" not in ok.json()["headers"]
        bad_method = c.post("https://api.allowed.test/v1/models")
        assert bad_method.status_code == 403
        assert bad_method.json()["rule"].endswith("agent.yaml:6")
        assert "POST" in reason_of(bad_method.json())
        bad_path = c.get("https://api.allowed.test/admin")
        assert bad_path.status_code == 403
        assert bad_path.headers["x-sandbox-gateway-error"] == "policy_denied"


def test_rules_are_named_relative_to_the_policies_directory(gateway: GatewayThread,
                                                           upstream: Upstream) -> None:
    """Refusal bodies, audit lines and explain answers name `policies/agent.yaml:6`,
    never the gateway host's absolute path to it."""
    host_path = str(gateway.config.policies)
    token = gateway.mint("agent")
    with client(gateway, token) as c:
        refused = c.post("https://api.allowed.test/v1/models")
    assert refused.status_code == 403
    assert refused.json()["rule"] == "policies/agent.yaml:6"
    assert "policies/agent.yaml:6" in reason_of(refused.json())
    assert host_path not in refused.text and host_path not in json.dumps(dict(refused.headers))
    status, _, body = connect(gateway, "evil.test:443", token)  # reason names the file
    assert status == 403 and body is not None and "policies/agent.yaml" in body["reason"]
    assert host_path not in json.dumps(body)
    lines = gateway.audit.wait_for(lambda r: r["method"] == "POST")
    assert lines and lines[-1]["rule"] == "policies/agent.yaml:6"
    assert host_path not in json.dumps(gateway.audit.records())
    admin = {"Authorization": f"Bearer {gateway.gateway.admin_token}"}
    explained = httpx.post(f"{gateway.admin}/v1/explain", headers=admin, json={
        "policy": "agent", "method": "GET", "url": "https://api.allowed.test/v1/x"}).json()
    assert explained["rule"] == "policies/agent.yaml:6", explained
    assert host_path not in json.dumps(explained)


def test_requests_library(gateway: GatewayThread, upstream: Upstream) -> None:
    token = gateway.mint("agent")
    proxies = {"https": gateway.proxy_url(token), "http": gateway.proxy_url(token)}
    r = requests.get("https://other.test/x", proxies=proxies, verify=str(gateway.ca_cert),
                     timeout=10)
    assert r.status_code == 200 and r.json()["path"] == "/x"
    with pytest.raises(requests.exceptions.ProxyError):
        requests.get("https://nope.test/", proxies=proxies, verify=str(gateway.ca_cert),
                     timeout=10)


def test_host_header_must_match_tunnel(gateway: GatewayThread, upstream: Upstream) -> None:
    token = gateway.mint("agent")
    before = len(upstream.requests)
    with client(gateway, token) as c:
        r = c.get("https://other.test/x", headers={"Host": "allowed.test"})
    assert r.status_code == 403
    assert code_of(r.json()) == "host_mismatch"
    assert len(upstream.requests) == before


@pytest.mark.parametrize("token", [None, "garbage", "a.b.c"])
def test_missing_or_garbage_token_is_407(gateway: GatewayThread, token: str | None) -> None:
    status, headers, body = connect(gateway, "allowed.test:443", token)
    assert status == 407
    assert "proxy-authenticate" in headers
    assert body is not None and body["error"] in {"auth_required", "token_malformed"}


def test_expired_and_revoked_tokens(gateway: GatewayThread) -> None:
    expired = gateway.gateway.tokens
    minted = expired.mint("sandbox-1", "agent", {}, ttl=1)
    time.sleep(1.1)
    status, _, body = connect(gateway, "other.test:443", minted.token)
    assert status == 407 and body is not None and body["error"] == "token_expired"

    live = expired.mint("sandbox-1", "agent", {})
    assert curl(gateway, "https://other.test/", live.token)[0] == 200
    admin = {"Authorization": f"Bearer {gateway.gateway.admin_token}"}
    r = httpx.post(f"{gateway.admin}/v1/tokens/revoke", json={"jti": live.jti}, headers=admin)
    assert r.status_code == 200
    status, _, body = connect(gateway, "other.test:443", live.token)
    assert status == 407 and body is not None and body["error"] == "token_revoked"


def test_revocation_applies_inside_an_open_tunnel(gateway: GatewayThread) -> None:
    minted = gateway.gateway.tokens.mint("sandbox-1", "agent", {})
    with client(gateway, minted.token) as c:
        assert c.get("https://other.test/1").status_code == 200
        admin = {"Authorization": f"Bearer {gateway.gateway.admin_token}"}
        httpx.post(f"{gateway.admin}/v1/tokens/revoke", json={"jti": minted.jti}, headers=admin)
        r = c.get("https://other.test/2")
        assert r.status_code == 407 and code_of(r.json()) == "token_revoked"


def test_username_must_be_the_sandbox(gateway: GatewayThread) -> None:
    token = gateway.mint("agent", sandbox="sandbox-1")
    assert gateway.gateway.proxy_address
    status, _, body = raw_connect(gateway.gateway.proxy_address, "other.test:443", token,
                                  sandbox="someone-else")
    assert status == 407 and body is not None and body["error"] == "sandbox_mismatch"


def test_plain_http_proxy_request(gateway: GatewayThread, make_gateway: GatewayFactory) -> None:
    token = gateway.mint("agent")
    status, body, _ = curl(gateway, "http://evil.test/", token)
    assert status == 403 and json.loads(body)["error"] == "policy_denied"
    status, body, _ = curl(gateway, "http://other.test/", None)
    assert status == 407


def test_report_mode_allows_and_records_would_deny(make_gateway: GatewayFactory) -> None:
    gw = make_gateway({"r.yaml": "version: v1\nname: watch\nmode: report\negress:\n"
                                 "  - host: allowed.test\n"})
    token = gw.mint("watch")
    with client(gw, token) as c:
        r = c.get("https://other.test/anything")
    assert r.status_code == 200
    records = gw.audit.wait_for(lambda x: x["host"] == "other.test")
    assert records and records[-1]["decision"] == "report", gw.audit.getvalue()


def test_audit_line_fields_and_no_token(gateway: GatewayThread) -> None:
    token = gateway.mint("agent")
    with client(gateway, token) as c:
        c.get("https://other.test/path?secret=1")
        with pytest.raises(httpx.ProxyError):
            c.get("https://evil.test/")
    gateway.audit.wait_for(lambda x: x["host"] == "other.test")
    records = gateway.audit.records()
    text = gateway.audit.getvalue()
    assert token not in text and "secret=1" not in text
    allow = next(r for r in records if r["host"] == "other.test")
    for field in ("time", "sandbox", "policy", "jti", "client", "method", "scheme", "host",
                  "port", "path", "decision", "reason", "rule", "status", "bytes_in",
                  "bytes_out", "duration_ms", "path_taken"):
        assert field in allow, field
    assert allow["decision"] == "allow" and allow["path"] == "/path"
    assert allow["path_taken"] == "intercept" and allow["status"] == 200
    deny = next(r for r in records if r["host"] == "evil.test")
    assert deny["decision"] == "deny" and deny["status"] == 403


def test_hot_reload_valid_and_invalid(gateway: GatewayThread) -> None:
    token = gateway.mint("agent")
    pdir = gateway.config.policies
    assert curl(gateway, "https://report.test/", token)[0] == 403
    (pdir / "agent.yaml").write_text((pdir / "agent.yaml").read_text()
                                     + "  - host: report.test\n    inspect: true\n")
    deadline = time.time() + 5
    while time.time() < deadline and curl(gateway, "https://report.test/", token)[0] != 200:
        time.sleep(0.3)
    assert curl(gateway, "https://report.test/", token)[0] == 200
    # An invalid change is refused: the last good set keeps serving.
    (pdir / "agent.yaml").write_text("version: v1\nname: agent\negress:\n  - hots: x\n")
    time.sleep(2.5)
    assert curl(gateway, "https://report.test/", token)[0] == 200
    metrics = httpx.get(f"{gateway.admin}/metrics").text
    assert 'sandbox_gateway_policy_reloads_total{result="error"}' in metrics


def test_admin_api(gateway: GatewayThread) -> None:
    admin = {"Authorization": f"Bearer {gateway.gateway.admin_token}"}
    assert httpx.get(f"{gateway.admin}/healthz").status_code == 200
    assert httpx.get(f"{gateway.admin}/readyz").json()["ready"] is True
    assert httpx.post(f"{gateway.admin}/v1/tokens", json={"sandbox": "s", "policy": "agent"}
                      ).status_code == 401
    r = httpx.post(f"{gateway.admin}/v1/tokens", json={"sandbox": "s", "policy": "agent",
                                                        "ttl": "5m"}, headers=admin)
    assert r.status_code == 200 and set(r.json()) == {"token", "jti", "expires_at"}
    assert r.json()["expires_at"] - time.time() < 301
    r = httpx.post(f"{gateway.admin}/v1/tokens", json={"sandbox": "s", "policy": "nope"},
                   headers=admin)
    assert r.status_code == 400 and "nope" in reason_of(r.json())
    r = httpx.post(f"{gateway.admin}/v1/tokens", json={"sandbox": "s", "policy": "agent",
                                                        "ttl": "48h"}, headers=admin)
    assert r.status_code == 400 and "max_ttl" in reason_of(r.json())
    pols = httpx.get(f"{gateway.admin}/v1/policies", headers=admin).json()["policies"]
    assert [p["name"] for p in pols] == ["agent"]
    r = httpx.post(f"{gateway.admin}/v1/explain", headers=admin, json={
        "policy": "agent", "method": "POST", "url": "https://api.allowed.test/v1/x"})
    assert r.json()["decision"] == "deny"
    jwks = httpx.get(f"{gateway.admin}/.well-known/jwks.json").json()
    assert jwks["keys"][0]["kty"] == "OKP"
    assert "sandbox_gateway_requests_total" in httpx.get(f"{gateway.admin}/metrics").text


def test_upstream_failure_is_a_json_502(make_gateway: GatewayFactory) -> None:
    import socket as _socket

    with _socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    gw = make_gateway(config={"network": {"resolve": {"other.test": f"127.0.0.1:{dead}"}}})
    token = gw.mint("agent")
    with client(gw, token) as c:
        r = c.get("https://other.test/x")
    assert r.status_code == 502
    assert r.headers["x-sandbox-gateway-error"] == "upstream_failed"
    assert code_of(r.json()) == "upstream_failed" and "could not be reached" in reason_of(r.json())


def test_passthrough_audit_counts_bytes(gateway: GatewayThread, test_ca: Any) -> None:
    token = gateway.mint("agent")
    ctx = ssl.create_default_context(cafile=test_ca.cert_path)
    with httpx.Client(proxy=gateway.proxy_url(token), verify=ctx, timeout=10) as c:
        assert c.get("https://allowed.test/bytes/100000").status_code == 200
    lines = gateway.audit.wait_for(lambda r: r["host"] == "allowed.test"
                                   and r["path_taken"] == "passthrough")
    assert lines and lines[-1]["bytes_in"] > 100_000 and lines[-1]["bytes_out"] > 0
    assert lines[-1]["decision"] == "allow" and lines[-1]["rule"].endswith("agent.yaml:5")


def test_idle_upstream_connection_is_closed_and_reopened(make_gateway: GatewayFactory,
                                                         upstream: Upstream) -> None:
    gw = make_gateway(config={"network": {"upstream_idle_timeout": 1}})
    token = gw.mint("agent")
    with client(gw, token) as c:
        before = upstream.connections
        assert c.get("https://other.test/first").status_code == 200
        assert c.get("https://other.test/second").status_code == 200
        assert upstream.connections == before + 1  # kept alive while in use
        time.sleep(2.5)  # idle past the timeout: the gateway drops its upstream connection
        r = c.get("https://other.test/third")  # same sandbox connection, new upstream one
        assert r.status_code == 200 and r.json()["path"] == "/third"
        assert upstream.connections == before + 2


def _send_head(proxy: tuple[str, int], head: bytes) -> tuple[int, dict[str, Any] | None]:
    with socket.create_connection(proxy, timeout=10) as sock:
        sock.sendall(head)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    top, _, body = data.partition(b"\r\n\r\n")
    return int(top.split()[1]), json.loads(body) if body.strip() else None


@pytest.mark.parametrize(("name", "head"), [
    ("a space before the colon", b"CONNECT other.test:443 HTTP/1.1\r\nHost: other.test:443\r\n"
                                 b"Proxy-Authorization : Basic {cred}\r\n\r\n"),
    ("two Proxy-Authorization fields", b"CONNECT other.test:443 HTTP/1.1\r\nHost: other.test:443"
                                       b"\r\nProxy-Authorization: Basic {cred}\r\n"
                                       b"Proxy-Authorization: Basic {cred}\r\n\r\n"),
    ("not HTTP/1.x", b"CONNECT other.test:443 HTTP/2.0\r\nHost: other.test:443\r\n"
                     b"Proxy-Authorization: Basic {cred}\r\n\r\n"),
    ("a request line of two words", b"CONNECT other.test:443\r\n\r\n"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_the_front_door_reads_heads_as_the_http1_engine_does(
        gateway: GatewayThread, name: str, head: bytes) -> None:
    """The CONNECT head goes through the parser every HTTP/1 head goes through (h11): a
    head it refuses is refused 400 and audited, whatever a laxer reader would take."""
    cred = base64.b64encode(f"sandbox-1:{gateway.mint('agent')}".encode())
    assert gateway.gateway.proxy_address
    status, body = _send_head(gateway.gateway.proxy_address, head.replace(b"{cred}", cred))
    assert status == 400 and body is not None and body["error"] == "bad_request", (name, body)
    line = gateway.audit.wait_for(lambda r: r["error"] == "bad_request")[-1]
    assert line["decision"] == "deny" and cred.decode() not in json.dumps(line)


@pytest.mark.parametrize("version", ["HTTP/1.0", "HTTP/1.1"])
def test_a_connect_without_host_is_read(gateway: GatewayThread, version: str) -> None:
    """Python 3.11's http.client tunnels with `CONNECT h:p HTTP/1.0` and no Host; other
    clients send HTTP/1.1 without Host (the authority is in the request line)."""
    cred = base64.b64encode(f"sandbox-1:{gateway.mint('agent')}".encode()).decode()
    assert gateway.gateway.proxy_address
    with socket.create_connection(gateway.gateway.proxy_address, timeout=10) as sock:
        sock.sendall(f"CONNECT other.test:443 {version}\r\nProxy-Authorization: Basic {cred}"
                     "\r\n\r\n".encode())
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
