"""Policies as code against a real run: record audit lines from the real gateway (real
clients through it to the local TLS upstream), then `policy diff --base HEAD --replay` a
narrowed policy in a git checkout; and the running gateway's revision and explain."""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import BASE_POLICY, GatewayFactory
from helpers.clients import raw_connect
from helpers.tls import LocalCA
from helpers.upstream import Upstream

from gateway.cli import main
from gateway.services.policy.revision import content_hash

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")

NARROWED = """
version: v1
name: agent
egress:
  - host: allowed.test
  - host: api.allowed.test
    methods: [GET, POST]
    paths: ["/v1/chat/**"]
  - host: new.test
"""


def git(cwd: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@example.com", HOME=str(cwd))
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env,
                          check=True).stdout.strip()


def record_traffic(make_gateway: GatewayFactory, test_ca: LocalCA) -> list[dict[str, Any]]:
    """Drive real clients through a real gateway; return its audit lines."""
    gw = make_gateway()
    token = gw.mint("agent")
    # allowed.test is host-only: passed through, curl sees the upstream's certificate
    out = subprocess.run(["curl", "-sS", "--max-time", "10", "-x", gw.proxy_url(token),
                          "--cacert", str(test_ca.cert_path), "https://allowed.test/hello"],
                         capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    verify = ssl.create_default_context(cafile=gw.ca_cert)
    with httpx.Client(proxy=gw.proxy_url(token), verify=verify, timeout=10) as client:
        assert client.get("https://api.allowed.test/v1/models").status_code == 200
        assert client.get("https://api.allowed.test/v1/chat/x").status_code == 200
        assert client.post("https://api.allowed.test/v1/chat/x").status_code == 403
        assert client.get("https://other.test/x").status_code == 200
    assert gw.gateway.proxy_address is not None
    status, _, body = raw_connect(gw.gateway.proxy_address, "new.test:443", token)
    assert status == 403 and body is not None and body["error"] == "policy_denied"

    # the running gateway: its revision, metric and explain with the destination check
    admin = {"Authorization": f"Bearer {gw.gateway.admin_token}"}
    policies_dir = Path(gw.config.policies)
    expected = content_hash({"agent.yaml": (policies_dir / "agent.yaml").read_bytes()})
    assert httpx.get(f"{gw.admin}/v1/policies", headers=admin).json()["revision"] == expected
    metrics = httpx.get(f"{gw.admin}/metrics").text
    assert f'sandbox_gateway_policy_info{{revision="{expected}"}} 1.0' in metrics
    explained = httpx.post(f"{gw.admin}/v1/explain", headers=admin, json={
        "policy": "agent", "method": "GET", "url": "https://api.allowed.test/v1/models",
        "resolve": True}).json()
    assert explained["decision"] == "allow"
    assert explained["destination"]["trusted"] is True  # network.resolve -> the upstream

    # one line per decision: the passthrough tunnel (written when it closes), four
    # intercepted requests, the refused CONNECT (intercepted tunnels have no line of their own)
    gw.audit.wait_for(lambda _: len(gw.audit.records()) >= 6, timeout=5)
    records = gw.audit.records()
    assert len(records) == 6, records
    return records


def test_narrowing_a_rule_lists_the_recorded_requests_it_denies(
        make_gateway: GatewayFactory, upstream: Upstream, test_ca: LocalCA, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    records = record_traffic(make_gateway, test_ca)
    seen = {(r["method"], r["host"], r["path"], r["decision"]) for r in records}
    assert ("CONNECT", "allowed.test", None, "allow") in seen
    assert ("CONNECT", "new.test", None, "deny") in seen
    assert ("GET", "api.allowed.test", "/v1/models", "allow") in seen
    assert ("POST", "api.allowed.test", "/v1/chat/x", "deny") in seen
    audit = tmp_path / "audit.jsonl"
    audit.write_text("".join(json.dumps(r) + "\n" for r in records))

    # the policy as it ran, committed; the narrowed one proposed in the working tree
    repo = tmp_path / "repo"
    (repo / "policies").mkdir(parents=True)
    (repo / "policies" / "agent.yaml").write_text(BASE_POLICY)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "the policy that served the recorded traffic")
    (repo / "policies" / "agent.yaml").write_text(NARROWED)

    argv = ["policy", "diff", "--base", "main", str(repo / "policies"), "--replay", str(audit)]
    assert main([*argv, "--format", "json", "--fail-on", "newly-denied"]) == 1
    report = json.loads(capsys.readouterr().out)["replay"]
    assert report["lines"] == len(records)

    def requests(category: str) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for group in report[category]:
            assert group["policy"] == "agent"
            out[group["host"]] = {e["request"] for e in group["examples"]}
        return out

    denied = requests("newly_denied")
    assert denied["api.allowed.test"] == {"GET https://api.allowed.test/v1/models"}
    assert "GET https://other.test/x" in denied["other.test"]  # its rule is gone
    assert set(denied) == {"api.allowed.test", "other.test"}
    assert requests("newly_allowed") == {
        "api.allowed.test": {"POST https://api.allowed.test/v1/chat/x"},
        "new.test": {"CONNECT new.test:443"},
    }
    # unchanged: the passthrough tunnel and GET /v1/chat/x
    assert main([*argv, "--format", "markdown"]) == 0
    comment = capsys.readouterr().out
    assert comment.index("#### Newly denied") < comment.index("#### Newly allowed")
    assert "| `agent` | rule removed | `other.test` |" in comment
