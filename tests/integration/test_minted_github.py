"""GitHub App tokens minted by the gateway: a real `git clone` and `git push` and API
calls from a sandbox process that holds only its gateway token, against a fake GitHub
that verifies the App JWT (RS256, iss, expiry) and serves git with `git http-backend`."""

from __future__ import annotations

import logging
import os
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from fakes.github import FakeGitHub
from helpers.gateway import GatewayFactory, GatewayThread
from helpers.metrics import metric

from gateway.tools.sandbox_env import sandbox_env

POLICY = """
version: v1
name: agent
egress:
  - host: github.com
    credential: github
  - host: api.github.com
    credential: github
credentials:
  github:
    type: github-app
    app_id: {app_id}
    installation_id: {installation}
    private_key: gh-app-key
    repositories: [tools]
    permissions: {{contents: write, metadata: read}}
"""


@pytest.fixture
def github(tmp_path: Path) -> Iterator[FakeGitHub]:
    with FakeGitHub(tmp_path / "github") as fake:
        assert isinstance(fake, FakeGitHub)
        fake.create_repo("acme", "tools", {"README.md": "tools\n"})
        yield fake


def _gateway(make_gateway: GatewayFactory, tmp_path: Path, github: FakeGitHub,
             intercept: str = "fast") -> GatewayThread:
    secrets = tmp_path / "secrets.yaml"
    secrets.write_text(yaml.safe_dump({"gh-app-key": github.private_key_pem}))
    secrets.chmod(0o600)
    policy = POLICY.format(app_id=github.app_id, installation=github.installation_id)
    return make_gateway({"agent.yaml": policy}, config={
        "secrets": {"store": "file", "path": str(secrets)},
        "network": {"upstream_ca": str(github.ca_path), "resolve": github.resolve(),
                    "intercept": intercept}})


def _sandbox(gw: GatewayThread, token: str, home: Path) -> dict[str, str]:
    """The environment `sandbox-gateway env` prints, and nothing else of this host's."""
    home.mkdir(exist_ok=True)
    env = dict(line.split("=", 1) for line in sandbox_env(token, gw.proxy,
                                                          ca_bundle=str(gw.ca_cert)))
    env.update({"PATH": os.environ["PATH"], "HOME": str(home), "GIT_TERMINAL_PROMPT": "0",
                "GIT_AUTHOR_NAME": "agent", "GIT_AUTHOR_EMAIL": "agent@example.test",
                "GIT_COMMITTER_NAME": "agent", "GIT_COMMITTER_EMAIL": "agent@example.test"})
    return env


def _git(env: dict[str, str], *args: str, cwd: Path | None = None) -> str:
    out = subprocess.run(["git", *args], env=env, cwd=cwd, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout + out.stderr


@pytest.mark.parametrize("intercept", ["fast", "mitmproxy"])
def test_git_clone_push_and_api_with_a_minted_installation_token(
        make_gateway: GatewayFactory, tmp_path: Path, github: FakeGitHub, intercept: str,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    gw = _gateway(make_gateway, tmp_path, github, intercept)
    token = gw.mint("agent")
    before = metric(gw, "sandbox_gateway_credential_mints_total", type="github-app",
                    result="ok")
    env = _sandbox(gw, token, tmp_path / "home")
    work = tmp_path / "clone"
    seen = _git(env, "clone", "https://github.com/acme/tools.git", str(work))
    assert (work / "README.md").read_text() == "tools\n"
    (work / "NOTES.md").write_text("pushed through the gateway\n")
    seen += _git(env, "add", "NOTES.md", cwd=work)
    seen += _git(env, "commit", "-q", "-m", "from the sandbox", cwd=work)
    seen += _git(env, "push", "origin", "main", cwd=work)
    pushed = subprocess.run(["git", "--git-dir", str(github.root / "acme" / "tools.git"),
                             "log", "-1", "--format=%s"], capture_output=True, text=True)
    assert pushed.stdout.strip() == "from the sandbox"

    # gh-style API calls: GH_TOKEN as Bearer, and GitHub's own `token` scheme.
    client = httpx.Client(proxy=gw.proxy_url(token), timeout=20,
                          verify=ssl.create_default_context(cafile=gw.ca_cert))
    with client:
        repo = client.get("https://api.github.com/repos/acme/tools",
                          headers={"Authorization": f"Bearer {env['GH_TOKEN']}"})
        assert repo.status_code == 200 and repo.json()["full_name"] == "acme/tools"
        listed = client.get("https://api.github.com/installation/repositories",
                            headers={"Authorization": f"token {env['GH_TOKEN']}"})
        assert listed.status_code == 200 and listed.json()["total_count"] == 1
        echo = client.get("https://api.github.com/echo",
                          headers={"Authorization": f"Bearer {token}"})
        assert echo.status_code == 200
        assert echo.json()["authorization"] == "Bearer [REDACTED]"  # the echo is redacted
        seen += repo.text + listed.text + echo.text + str(echo.headers)

    # One mint served every request; the exchange asked for the narrowed installation.
    assert github.mint_count == 1 and not github.jwt_failures
    assert github.mints[0] == {"repositories": ["tools"],
                               "permissions": {"contents": "write", "metadata": "read"}}
    assert metric(gw, "sandbox_gateway_credential_mints_total", type="github-app",
                  result="ok") == before + 1
    minted = list(github.tokens)
    assert len(minted) == 1
    # The upstream saw the minted token, never the gateway token.
    for request in github.requests:
        assert token not in repr(request.headers)
    git_auth = [r.headers.get("authorization", "") for r in github.requests
                if r.host == "github.com" and "authorization" in r.headers]
    assert git_auth and all(a.startswith("Basic ") for a in git_auth)
    # The minted token reached nothing the sandbox or an operator reads.
    text = seen + gw.audit.getvalue() + httpx.get(f"{gw.admin}/metrics").text + caplog.text
    assert minted[0] not in text and github.private_key_pem.splitlines()[1] not in text
    lines = gw.audit.records()
    assert any(r.get("credential") == "github" and r["host"] == "github.com" for r in lines)
    # git's first, unauthenticated request was answered with a Basic challenge.
    assert any(r.get("error") == "credential_required" and r["status"] == 401 for r in lines)


def test_a_rejected_token_is_minted_again(make_gateway: GatewayFactory, tmp_path: Path,
                                          github: FakeGitHub) -> None:
    gw = _gateway(make_gateway, tmp_path, github)
    token = gw.mint("agent")
    with httpx.Client(proxy=gw.proxy_url(token), timeout=20,
                      verify=ssl.create_default_context(cafile=gw.ca_cert)) as client:
        url = "https://api.github.com/repos/acme/tools"
        auth = {"Authorization": f"Bearer {token}"}
        assert client.get(url, headers=auth).status_code == 200
        (first,) = list(github.tokens)
        github.revoke(first)
        assert client.get(url, headers=auth).status_code == 401  # relayed, then re-minted
        assert client.get(url, headers=auth).status_code == 200
        assert client.get(url, headers=auth).status_code == 200
    assert github.mint_count == 2


def test_a_bad_private_key_answers_503_credential_unavailable(
        make_gateway: GatewayFactory, tmp_path: Path, github: FakeGitHub) -> None:
    other = FakeGitHub(tmp_path / "other")  # another App's key: GitHub refuses its JWT
    github.private_key_pem = other.private_key_pem
    gw = _gateway(make_gateway, tmp_path, github)
    token = gw.mint("agent")
    before = metric(gw, "sandbox_gateway_credential_mints_total", type="github-app",
                    result="error")
    with httpx.Client(proxy=gw.proxy_url(token), timeout=20,
                      verify=ssl.create_default_context(cafile=gw.ca_cert)) as client:
        r = client.get("https://api.github.com/repos/acme/tools",
                       headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 503
    assert r.headers["x-sandbox-gateway-error"] == "credential_unavailable"
    assert "answered 401" in r.json()["reason"] and "check app_id" in r.json()["reason"]
    assert github.jwt_failures and github.mint_count == 0
    assert metric(gw, "sandbox_gateway_credential_mints_total", type="github-app",
                  result="error") == before + 1
