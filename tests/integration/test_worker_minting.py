"""Minted credentials with two worker processes (`run --workers 2`), through the SQLite
state file: one mint per credential for the host, a restart reuses the value still
valid, and a refresh token the server rotated (retiring the old one) is the one every
worker and the next start use (issue 21). Measured before: each worker minted its own
GitHub App token; after a rotation, the other worker (and any restart) sent the retired
refresh token and got `invalid_grant`."""

from __future__ import annotations

import signal
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from fakes.github import FakeGitHub
from fakes.oauth import INTERNAL, LOGIN, FakeOAuth
from helpers.process import GatewayProcess, start_gateway
from helpers.tls import LocalCA

GITHUB_POLICY = """
version: v1
name: agent
egress:
  - host: api.github.com
    credential: github
credentials:
  github:
    type: github-app
    app_id: {app_id}
    installation_id: {installation}
    private_key: gh-app-key
"""
OAUTH_POLICY = f"""
version: v1
name: agent
egress:
  - host: refreshed.{INTERNAL}
    credential: refreshed
credentials:
  refreshed:
    type: oauth2-refresh-token
    token_url: https://{LOGIN}/oauth2/token
    client_id: gateway-client
    refresh_token: oauth-refresh-token
    client_auth: body
    hosts: [refreshed.{INTERNAL}]
"""


@pytest.fixture
def github(tmp_path: Path) -> Iterator[FakeGitHub]:
    with FakeGitHub(tmp_path / "github") as fake:
        assert isinstance(fake, FakeGitHub)
        fake.create_repo("acme", "tools", {"README.md": "tools\n"})
        yield fake


@pytest.fixture
def oauth(tmp_path: Path) -> Iterator[FakeOAuth]:
    # Tokens live 4 s: the gateway refreshes each about every 2 s, so a few seconds of
    # calls rotate the refresh token several times, from whichever worker is asked.
    with FakeOAuth(tmp_path / "oauth", token_lifetime=4, rotate_refresh_tokens=True) as fake:
        assert isinstance(fake, FakeOAuth)
        yield fake


def _start(workdir: Path, policy: str, secrets: dict[str, str], upstream_ca: Path,
           resolve: dict[str, str], test_ca: LocalCA) -> GatewayProcess:
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "secrets.yaml"
    path.write_text(yaml.safe_dump(secrets))
    path.chmod(0o600)
    ports = {host: int(target.rsplit(":", 1)[1]) for host, target in resolve.items()}
    return start_gateway(workdir, ports, test_ca, policy=policy, workers=2, extra={
        "secrets": {"store": "file", "path": str(path)},
        "network": {"upstream_ca": str(upstream_ca)}})


def _get(gw: GatewayProcess, token: str, url: str) -> int:
    """One GET on a new connection (the kernel picks the worker)."""
    with httpx.Client(proxy=f"http://sbx:{token}@127.0.0.1:{gw.proxy}", timeout=20,
                      verify=ssl.create_default_context(
                          cafile=str(gw.workdir / "certs" / "ca.crt"))) as http:
        return http.get(url, headers={"Authorization": f"Bearer {token}"}).status_code


def _workers(gw: GatewayProcess) -> set[int]:
    return {line["worker"] for line in gw.audit_lines() if line.get("status") == 200}


def _restart(gw: GatewayProcess, start: object) -> GatewayProcess:
    gw.proc.send_signal(signal.SIGTERM)
    assert gw.proc.wait(30) == 0
    gw.stop()
    assert callable(start)
    again = start()
    assert isinstance(again, GatewayProcess)
    return again


def test_one_github_app_token_for_both_workers_and_after_a_restart(
        tmp_path: Path, github: FakeGitHub, test_ca: LocalCA) -> None:
    policy = GITHUB_POLICY.format(app_id=github.app_id, installation=github.installation_id)

    def start() -> GatewayProcess:
        return _start(tmp_path / "gw", policy, {"gh-app-key": github.private_key_pem},
                      github.ca_path, github.resolve(), test_ca)

    gw = start()
    try:
        token = gw.token("sbx")
        url = "https://api.github.com/installation/repositories"
        for _ in range(40):
            assert _get(gw, token, url) == 200
            if len(_workers(gw)) == 2 and len(gw.audit_lines()) >= 8:
                break
        assert _workers(gw) == {0, 1}, "the calls did not reach both workers"
        assert github.mint_count == 1
        gw = _restart(gw, start)
        for _ in range(4):
            assert _get(gw, token, url) == 200
        assert github.mint_count == 1  # (the token minted before the restart, still valid)
    finally:
        gw.stop()


def test_a_rotated_refresh_token_is_used_by_every_worker_and_after_a_restart(
        tmp_path: Path, oauth: FakeOAuth, test_ca: LocalCA) -> None:
    def start() -> GatewayProcess:
        return _start(tmp_path / "gw", OAUTH_POLICY, {"oauth-refresh-token": oauth.refresh_token},
                      oauth.ca_path, oauth.resolve(), test_ca)

    gw = start()
    try:
        token = gw.token("sbx")
        url = f"https://refreshed.{INTERNAL}/v1/items"
        deadline = time.monotonic() + 6
        statuses = []
        while time.monotonic() < deadline:
            statuses.append(_get(gw, token, url))
            time.sleep(0.1)
        assert set(statuses) == {200}, statuses
        assert _workers(gw) == {0, 1}
        grants = oauth.count("refresh_token")
        assert 2 <= grants <= 5, grants  # (one per refresh for the host, not per worker)
        assert not oauth.failures
        time.sleep(4.5)  # (the last access token expires: the next start must mint)
        gw = _restart(gw, start)
        assert _get(gw, token, url) == 200
        assert oauth.count("refresh_token") == grants + 1 and not oauth.failures
    finally:
        gw.stop()
