"""Google service-account tokens (google-auth against a fake token endpoint that checks
the RS256 assertion) for a Vertex-style call, and OAuth2 client-credentials and
refresh-token grants for an internal API; the minting cache: one mint for 100
concurrent requests, refresh before expiry, backoff after a failed mint."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from fakes.oauth import INTERNAL, JWT_BEARER, LOGIN, VERTEX, FakeOAuth
from helpers.gateway import GatewayFactory, GatewayThread
from helpers.metrics import metric

from gateway.tools.sandbox_env import sandbox_env

POLICY = """
version: v1
name: agent
egress:
  - host: {vertex}
    credential: vertex
  - host: {internal}
    credential: internal
    paths: ["/v1/items", "/v1/echo"]
  - host: refreshed.{internal}
    credential: refreshed
credentials:
  vertex:
    type: gcp-service-account
    key: gcp-sa-key
    scopes: ["https://www.googleapis.com/auth/cloud-platform"]
  internal:
    type: oauth2-client-credentials
    token_url: https://{login}/oauth2/token
    client_id: gateway-client
    client_secret: {client_secret}
    scope: items.read
    hosts: [{internal}]
  refreshed:
    type: oauth2-refresh-token
    token_url: https://{login}/oauth2/token
    client_id: gateway-client
    refresh_token: oauth-refresh-token
    client_auth: body
    hosts: [refreshed.{internal}]
"""
VERTEX_CALL = r"""
import json, os, httpx
url = ("https://us-central1-aiplatform.googleapis.com/v1/projects/sandbox-project/locations/"
       "us-central1/publishers/google/models/gemini-2.0-flash:generateContent")
r = httpx.post(url, headers={"Authorization": "Bearer " + os.environ["CLOUDSDK_AUTH_ACCESS_TOKEN"]},
               json={"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}, timeout=30)
print(json.dumps({"status": r.status_code, "body": r.json()}))
"""


@pytest.fixture
def oauth(tmp_path: Path) -> Iterator[FakeOAuth]:
    with FakeOAuth(tmp_path / "oauth") as fake:
        assert isinstance(fake, FakeOAuth)
        yield fake


def _gateway(make_gateway: GatewayFactory, tmp_path: Path, oauth: FakeOAuth,
             client_secret: str | None = None) -> GatewayThread:
    secrets = tmp_path / "secrets.yaml"
    secrets.write_text(yaml.safe_dump({
        "gcp-sa-key": json.dumps(oauth.service_account_info()),
        "oauth-client-secret": client_secret or oauth.client_secret,
        "oauth-refresh-token": oauth.refresh_token}))
    secrets.chmod(0o600)
    resolve = oauth.resolve()
    policy = POLICY.format(vertex=VERTEX, internal=INTERNAL, login=LOGIN,
                           client_secret="oauth-client-secret")
    return make_gateway({"agent.yaml": policy}, config={
        "secrets": {"store": "file", "path": str(secrets)},
        "network": {"upstream_ca": str(oauth.ca_path), "resolve": resolve}})


def _client(gw: GatewayThread, token: str) -> httpx.Client:
    return httpx.Client(proxy=gw.proxy_url(token), timeout=30,
                        verify=ssl.create_default_context(cafile=gw.ca_cert))


def test_vertex_call_with_a_service_account_token(make_gateway: GatewayFactory,
                                                  tmp_path: Path, oauth: FakeOAuth,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    gw = _gateway(make_gateway, tmp_path, oauth)
    token = gw.mint("agent")
    env = dict(line.split("=", 1) for line in sandbox_env(token, gw.proxy,
                                                          ca_bundle=str(gw.ca_cert)))
    env.update({"PATH": os.environ["PATH"], "HOME": str(tmp_path)})
    runs = [subprocess.run([sys.executable, "-c", VERTEX_CALL], env=env, capture_output=True,
                           text=True, timeout=60) for _ in range(2)]
    for out in runs:
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(out.stdout)
        assert result["status"] == 200, result
        assert result["body"]["candidates"][0]["content"]["parts"][0]["text"] == \
            "Vertex says hi."
    # google-auth's assertion was verified (signature, iss, aud, scope) once for both.
    assert oauth.count(JWT_BEARER) == 1 and not oauth.failures
    assert oauth.grants[0][2] == "https://www.googleapis.com/auth/cloud-platform"
    minted = [t for t, (kind, _) in oauth.tokens.items() if kind == "google"]
    text = "".join(o.stdout + o.stderr for o in runs) + gw.audit.getvalue() + caplog.text + \
        httpx.get(f"{gw.admin}/metrics").text
    assert minted and minted[0] not in text
    assert oauth.sa_pem.splitlines()[1] not in text


def test_client_credentials_one_mint_for_100_concurrent_requests(
        make_gateway: GatewayFactory, tmp_path: Path, oauth: FakeOAuth) -> None:
    gw = _gateway(make_gateway, tmp_path, oauth)
    token = gw.mint("agent")

    async def burst() -> list[int]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(proxy=gw.proxy_url(token), timeout=60, limits=limits,
                                     verify=ssl.create_default_context(cafile=gw.ca_cert)
                                     ) as client:
            replies = await asyncio.gather(*(
                client.get(f"https://{INTERNAL}/v1/items",
                           headers={"Authorization": f"Bearer {token}"})
                for _ in range(100)))
        return [r.status_code for r in replies]

    assert asyncio.run(burst()) == [200] * 100
    assert oauth.count("client_credentials") == 1
    assert oauth.grants[0][2] == "items.read"
    # The minted token is echoed back redacted.
    with _client(gw, token) as client:
        echo = client.get(f"https://{INTERNAL}/v1/echo",
                          headers={"Authorization": f"Bearer {token}"})
    assert echo.json() == {"authorization": "Bearer [REDACTED]"}


def test_a_token_is_refreshed_before_it_expires(make_gateway: GatewayFactory, tmp_path: Path,
                                                oauth: FakeOAuth) -> None:
    oauth.token_lifetime = 6  # cached ~5.4 s, refreshed from ~2.7 s on
    gw = _gateway(make_gateway, tmp_path, oauth)
    token = gw.mint("agent")
    url = f"https://{INTERNAL}/v1/items"
    auth = {"Authorization": f"Bearer {token}"}
    with _client(gw, token) as client:
        assert client.get(url, headers=auth).status_code == 200
        (first, (_, first_expiry)), = oauth.tokens.items()
        time.sleep(3.2)
        assert client.get(url, headers=auth).status_code == 200  # served; refresh starts
        deadline = time.time() + 3
        while oauth.count("client_credentials") < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert oauth.count("client_credentials") == 2
        assert oauth.grants[1][1] < first_expiry  # minted again before the first expired
        time.sleep(max(0.0, first_expiry - time.time()) + 0.2)
        assert client.get(url, headers=auth).status_code == 200  # the new token serves
    used = [r.headers["authorization"] for r in oauth.requests if r.host == INTERNAL]
    assert used[0] == used[1] == f"Bearer {first}" and used[2] != used[0]
    assert not oauth.failures


def test_refresh_token_grant_follows_rotation(make_gateway: GatewayFactory, tmp_path: Path,
                                              oauth: FakeOAuth) -> None:
    oauth.rotate = True
    gw = _gateway(make_gateway, tmp_path, oauth)
    token = gw.mint("agent")
    url = f"https://refreshed.{INTERNAL}/v1/items"
    auth = {"Authorization": f"Bearer {token}"}
    with _client(gw, token) as client:
        assert client.get(url, headers=auth).status_code == 200
        (first,) = list(oauth.tokens)
        oauth.revoke(first)
        assert client.get(url, headers=auth).status_code == 401
        # The second mint had to use the rotated refresh token: the stored one is retired.
        assert client.get(url, headers=auth).status_code == 200
    assert oauth.count("refresh_token") == 2 and not oauth.failures


def test_a_failed_mint_answers_503_and_backs_off(make_gateway: GatewayFactory,
                                                 tmp_path: Path, oauth: FakeOAuth) -> None:
    gw = _gateway(make_gateway, tmp_path, oauth, client_secret="not-the-secret")
    token = gw.mint("agent")
    before = metric(gw, "sandbox_gateway_credential_mints_total",
                    type="oauth2-client-credentials", result="error")
    with _client(gw, token) as client:
        replies = [client.get(f"https://{INTERNAL}/v1/items",
                              headers={"Authorization": f"Bearer {token}"}) for _ in range(3)]
    for r in replies:
        assert r.status_code == 503 and r.json()["error"] == "credential_unavailable"
        assert "invalid_client" in r.json()["reason"] and "not-the-secret" not in r.text
    assert len(oauth.failures) == 1  # the retries failed fast during the backoff
    assert metric(gw, "sandbox_gateway_credential_mints_total",
                  type="oauth2-client-credentials", result="error") == before + 1
