"""A service preset with your credential beside it: a private repository on a fake
GitHub (git over `git http-backend`, 401 without a live App installation token) through
`service/github-write` and a `github-app` credential. The credential's rule names the git
paths: the real `git clone` and `git push` go, with the minted token swapped in for the
gateway token git's credential helper answers. Written host-wide (no `paths`), the
preset's rules, which name paths, are tried first and stay keyless (docs/policies.md,
"Which rule decides"), so git's retry carrying the gateway token is refused
`exfiltration_blocked`: the trap the presets' docs warn of."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fakes.github import FakeGitHub
from helpers.gateway import GatewayThread
from helpers.sandbox import Sandbox

POLICY = """\
version: v1
name: {name}
extends: [service/github-write]
egress:
  - host: github.com
    credential: github
{paths}"""
PATHS = '    paths: ["/*/*/info/refs", "/*/*/git-upload-pack", "/*/*/git-receive-pack"]\n'
CREDENTIAL = """\
credentials:
  github:
    type: github-app
    app_id: {app_id}
    installation_id: {installation}
    private_key: gh-app-key
"""


@pytest.fixture
def github(tmp_path: Path) -> Iterator[FakeGitHub]:
    with FakeGitHub(tmp_path / "github") as fake:
        assert isinstance(fake, FakeGitHub)
        fake.create_repo("acme", "tools", {"README.md": "tools\n"})
        subprocess.run(["git", "--git-dir", str(fake.root / "acme" / "tools.git"), "config",
                        "http.receivepack", "true"], check=True, timeout=30)
        yield fake


def _git(box: Sandbox, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return box.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                   timeout=90, GIT_TERMINAL_PROMPT="0")


def test_github_write_with_a_credential_rule_naming_its_paths(tmp_path: Path,
                                                             github: FakeGitHub) -> None:
    (tmp_path / "policies").mkdir()
    credential = CREDENTIAL.format(app_id=github.app_id, installation=github.installation_id)
    (tmp_path / "policies" / "p.yaml").write_text(
        POLICY.format(name="paths", paths=PATHS) + credential + "---\n"
        + POLICY.format(name="hostwide", paths=""))
    (tmp_path / "secrets.yaml").write_text(yaml.safe_dump({"gh-app-key":
                                                           github.private_key_pem}))
    (tmp_path / "secrets.yaml").chmod(0o600)
    gw = GatewayThread(tmp_path, {
        "network": {"upstream_ca": str(github.ca_path), "resolve": github.resolve()},
        "secrets": {"store": "file", "path": str(tmp_path / "secrets.yaml")}})
    try:
        boxes = {}
        for name in ("paths", "hostwide"):
            token = gw.mint(name, sandbox=name)
            boxes[name] = Sandbox.from_cli(tmp_path / "homes" / name, token=token,
                                           proxy=gw.proxy, ca_bundle=gw.ca_cert,
                                           node_preload=Path("none"),
                                           config=tmp_path / "gateway.yaml")
        box = boxes["paths"]
        cloned = _git(box, "clone", "-q", "https://github.com/acme/tools.git", "clone")
        assert cloned.returncode == 0, cloned.stderr
        work = box.home / "clone"
        (work / "NEW").write_text("pushed\n")
        assert _git(box, "add", "NEW", cwd=work).returncode == 0
        assert _git(box, "commit", "-q", "-m", "from the sandbox", cwd=work).returncode == 0
        pushed = _git(box, "push", "-q", "origin", "HEAD:main", cwd=work)
        assert pushed.returncode == 0, pushed.stderr
        keyed = gw.audit.wait_for(lambda r: r.get("sandbox") == "paths"
                                  and r["path"].endswith("/git-receive-pack"))
        lines = [r for r in gw.audit.records() if r.get("sandbox") == "paths"]
        hostwide = _git(boxes["hostwide"], "clone", "-q",
                        "https://github.com/acme/tools.git", "clone")
        refused = gw.audit.wait_for(lambda r: r.get("sandbox") == "hostwide"
                                    and r.get("decision") == "deny")
    finally:
        gw.stop()
    log = subprocess.run(["git", "--git-dir", str(github.root / "acme" / "tools.git"), "log",
                          "-1", "--format=%s"], capture_output=True, text=True, timeout=30)
    assert log.stdout.strip() == "from the sandbox"
    assert keyed and keyed[0]["credential"] == "github", keyed
    assert {(r["path"], r["rule"], r["credential"]) for r in lines if r["status"] == 200} == {
        ("/acme/tools.git/info/refs", "policies/p.yaml:5", "github"),
        ("/acme/tools.git/git-upload-pack", "policies/p.yaml:5", "github"),
        ("/acme/tools.git/git-receive-pack", "policies/p.yaml:5", "github")}, lines
    assert hostwide.returncode != 0 and "403" in hostwide.stderr, hostwide.stderr
    assert [(r["path"], r["error"]) for r in refused] == [
        ("/acme/tools.git/info/refs", "exfiltration_blocked")], refused


def test_a_static_basic_credential_is_sent_after_gits_challenge(tmp_path: Path,
                                                               github: FakeGitHub) -> None:
    """A static credential with a Basic carrier (a personal access token in the secret
    store): git sends no password until a 401 challenge, so the gateway answers its first
    request 401 `WWW-Authenticate: Basic` (not 403); git's credential helper then answers
    with the sandbox token, and the token is swapped for the stored one."""
    pat = "ghp_" + "s" * 36
    github.tokens[pat] = time.time() + 3600  # (the fake accepts it like a live token)
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "p.yaml").write_text(
        POLICY.format(name="pat", paths=PATHS)
        + "credentials:\n  github:\n    secret: github-pat\n    hosts: [github.com]\n"
          "    inject: {basic: x-access-token}\n")
    (tmp_path / "secrets.yaml").write_text(yaml.safe_dump({"github-pat": pat}))
    (tmp_path / "secrets.yaml").chmod(0o600)
    gw = GatewayThread(tmp_path, {
        "network": {"upstream_ca": str(github.ca_path), "resolve": github.resolve()},
        "secrets": {"store": "file", "path": str(tmp_path / "secrets.yaml")}})
    try:
        box = Sandbox.from_cli(tmp_path / "home", token=gw.mint("pat", sandbox="pat"),
                               proxy=gw.proxy, ca_bundle=gw.ca_cert, node_preload=Path("none"),
                               config=tmp_path / "gateway.yaml")
        cloned = _git(box, "clone", "-q", "https://github.com/acme/tools.git", "clone")
        lines = gw.audit.wait_for(lambda r: r.get("sandbox") == "pat" and r.get("status") == 200)
        every = [r for r in gw.audit.records() if r.get("sandbox") == "pat"]
    finally:
        gw.stop()
    assert cloned.returncode == 0, cloned.stderr
    assert (box.home / "clone" / "README.md").read_text() == "tools\n"
    assert [(r["status"], r.get("error")) for r in every][:1] == [(401, "credential_required")]
    assert lines and lines[0]["credential"] == "github", lines
