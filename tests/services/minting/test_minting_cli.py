"""`policy check --secrets` reads every secret a credential names and checks its shape;
`env` prints what each credential type needs (git helper per host, AWS placeholders)."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from gateway.cli import main

POLICY = """\
version: v1
name: agent
egress:
  - host: api.github.com
    credential: github
  - host: us-central1-aiplatform.googleapis.com
    credential: vertex
  - host: api.openai.com
    credential: openai
credentials:
  github: {type: github-app, app_id: 1, installation_id: 2, private_key: gh-key}
  vertex: {type: gcp-service-account, key: gcp-key}
  openai: {preset: openai, secret: openai-key}
"""


def _pem(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in [v for v in os.environ if v.startswith("SANDBOX_GATEWAY_")]:
        monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "agent.yaml").write_text(POLICY)
    return tmp_path


def _secrets(root: Path, values: dict[str, str]) -> None:
    path = root / "secrets.local.yaml"
    path.write_text(yaml.safe_dump(values))
    path.chmod(0o600)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_policy_check_secrets_good(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _secrets(workdir, {"gh-key": _pem(rsa_key), "openai-key": "sk-x", "gcp-key": json.dumps({
        "type": "service_account", "client_email": "a@b.iam.gserviceaccount.com",
        "private_key": _pem(rsa_key), "token_uri": "https://oauth2.googleapis.com/token"})})
    code, out, err = _run(capsys, "policy", "check", "--secrets")
    assert code == 0, err
    assert "3 credentials (their secrets present): OK" in out


def test_policy_check_secrets_reports_each_problem(workdir: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    ec_pem = _pem(ec.generate_private_key(ec.SECP256R1()))
    _secrets(workdir, {"gh-key": ec_pem, "gcp-key": '{"type": "authorized_user"}'})
    code, out, err = _run(capsys, "policy", "check", "--secrets")
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert any('credential "github" private_key: secret "gh-key" is not an RSA private key'
               in line for line in lines), err
    assert any('credential "vertex" key: secret "gcp-key" is not a service account key'
               in line for line in lines), err
    assert any('credential "openai" secret: secret "openai-key"' in line and
               "is not in the file store" in line for line in lines), err
    assert all(re.search(r"agent\.yaml:1[123]: ", line) for line in lines[:3])
    assert "BEGIN" not in err and lines[-1] == "3 secret problem(s)"


def _unsigned_token() -> str:
    """A gateway-shaped JWT (`env` checks the shape and expiry; the signature only with
    --config)."""
    def enc(obj: dict[str, object]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()
    claims = {"aud": "sandbox-gateway", "sub": "sb", "pol": "agent", "exp": 4_000_000_000,
              "jti": "j"}
    return f"{enc({'alg': 'EdDSA', 'kid': 'k1'})}.{enc(claims)}.c2ln"


def test_env_git_hosts_and_aws_placeholders(workdir: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    token = _unsigned_token()
    code, out, _ = _run(capsys, "env", "--token", token, "--proxy", "http://gw:8080",
                        "--git-host", "github.com", "--git-host", "ghe.example.com")
    assert code == 0
    env = dict(line.split("=", 1) for line in out.splitlines())
    assert env["GH_TOKEN"] == env["AWS_SESSION_TOKEN"] == token
    assert env["AWS_ACCESS_KEY_ID"] == "SANDBOXGATEWAYPLACEHOLDER"
    assert env["AWS_SECRET_ACCESS_KEY"] and env["AWS_SECRET_ACCESS_KEY"] != token
    assert env["GIT_CONFIG_COUNT"] == "2"
    assert env["GIT_CONFIG_KEY_0"] == "credential.https://github.com.helper"
    assert env["GIT_CONFIG_KEY_1"] == "credential.https://ghe.example.com.helper"
    # git runs the helper and reads the token as the password, for those hosts only.
    run_env = {"PATH": os.environ["PATH"], "HOME": str(workdir), **env}
    got = subprocess.run(["git", "credential", "fill"], input="protocol=https\nhost=github.com\n\n",
                         env=run_env, capture_output=True, text=True, timeout=10)
    assert "username=x-access-token" in got.stdout and f"password={token}" in got.stdout
    other = subprocess.run(["git", "credential", "fill"],
                           input="protocol=https\nhost=gitlab.com\n\n",
                           env={**run_env, "GIT_TERMINAL_PROMPT": "0"}, capture_output=True,
                           text=True, timeout=10)
    assert token not in other.stdout
