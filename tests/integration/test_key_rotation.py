"""One signing-key source: the CLI and the running gateway's admin API sign with the same
directory's newest key, and the gateway follows rotation and retirement without a restart."""

from __future__ import annotations

import ssl
import time
from pathlib import Path

import httpx
import jwt
import pytest
from helpers.gateway import GatewayFactory, GatewayThread

from gateway.cli import main

POLICY = "version: v1\nname: agent\negress:\n  - host: other.test\n    inspect: true\n"


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out.strip()


def through(gw: GatewayThread, token: str) -> int:
    """Status of one request through the proxy (200: the token was accepted)."""
    with httpx.Client(proxy=gw.proxy_url(token), timeout=10,
                      verify=ssl.create_default_context(cafile=gw.ca_cert)) as client:
        try:
            return client.get("https://other.test/ok").status_code
        except httpx.ProxyError as exc:
            assert "407" in str(exc), exc
            return 407


def admin_mint(gw: GatewayThread) -> str:
    r = httpx.post(f"{gw.admin}/v1/tokens", json={"sandbox": "sandbox-1", "policy": "agent"},
                   headers={"Authorization": f"Bearer {gw.gateway.admin_token}"}, timeout=10)
    assert r.status_code == 200, r.text
    return str(r.json()["token"])


def kid(token: str) -> str:
    return str(jwt.get_unverified_header(token)["kid"])


def wait_for(predicate: object, timeout: float = 5.0) -> float:
    """Seconds until `predicate()` held (fails after `timeout`)."""
    started = time.monotonic()
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() - started < timeout, "the gateway did not pick up the change"
        time.sleep(0.1)
    return time.monotonic() - started


def test_rotation_and_retirement_reach_a_running_gateway(
        make_gateway: GatewayFactory, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    gw = make_gateway({"agent.yaml": POLICY})
    config = str(tmp_path / "gateway.yaml")
    mint = ("token", "mint", "--config", config, "--sandbox", "sandbox-1", "--policy", "agent")

    before = cli(capsys, *mint)
    assert kid(before) == kid(admin_mint(gw)), "one key source for the CLI and the admin API"
    assert through(gw, before) == 200

    out = cli(capsys, "token", "rotate-key", "--config", config)
    assert "within 2 seconds (no restart)" in out
    after = cli(capsys, *mint)
    assert kid(after) != kid(before)
    # The admin API signs with the new key within the promised time, and the gateway
    # accepts what the CLI signed with it; the old key still verifies.
    waited = wait_for(lambda: kid(admin_mint(gw)) == kid(after))
    assert waited < 2.5
    assert through(gw, after) == 200
    assert through(gw, before) == 200
    jwks = httpx.get(f"{gw.admin}/.well-known/jwks.json", timeout=10).json()
    assert {k["kid"] for k in jwks["keys"]} == {kid(before), kid(after)}

    # Retiring the old key: its tokens are refused without a restart, new ones still work.
    cli(capsys, "token", "retire-key", "--config", config, kid(before))
    wait_for(lambda: through(gw, before) == 407)
    refused = [r for r in gw.audit.records() if r.get("error") == "token_unknown_key"]
    assert refused, "the refusal is audited with its code"
    assert through(gw, after) == 200


def test_a_broken_key_file_keeps_the_keys_in_use(
        make_gateway: GatewayFactory, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    gw = make_gateway({"agent.yaml": POLICY})
    token = admin_mint(gw)
    signing = gw.config.signing_dir
    (signing / "kzzzz.pem").write_text("-----BEGIN PRIVATE KEY-----\ncut short\n")
    time.sleep(2.5)  # two polls: the load fails, the keys in use stay
    assert kid(admin_mint(gw)) == kid(token)
    assert through(gw, token) == 200
    (signing / "kzzzz.pem").unlink()
    out = cli(capsys, "token", "rotate-key", "--config", str(tmp_path / "gateway.yaml"))
    assert "new signing key" in out
    wait_for(lambda: kid(admin_mint(gw)) != kid(token))

