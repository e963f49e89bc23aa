"""An agent CLI under learn mode, end to end: Aider (from PyPI, configured by `env`
alone) answers a message through a gateway whose policy is `mode: learn` with only the
provider's credential; `policy learn --replay` turns the audit lines into a policy; a
gateway enforcing that file runs the same Aider command unchanged, and refuses what
Aider did not do while learning (another model, another path). Against the stand-in
provider (tests/fakes/inference.py), which also answers for Aider's other hosts (its
price map on raw.githubusercontent.com, its update check on pypi.org: 404s)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fakes.inference import FakeInference
from helpers.gateway import GatewayThread
from helpers.python_clients import aider_cli
from helpers.sandbox import Sandbox

from gateway.cli import main as cli_main

KEY = "sk-learn-agent-provider-key-0123456789"
REPLY = "The fake provider answers."
LEARNING = """\
version: v1
name: agent
mode: learn
egress: []
credentials:
  openai: {preset: openai, secret: provider-key}
"""
HOSTS = ("api.openai.com", "raw.githubusercontent.com", "pypi.org")
# --no-analytics: Aider asks one new user in ten (a random id in its fresh HOME) to turn
# on PostHog analytics, which --yes-always accepts; the learning and the enforcing runs
# would then differ by us.i.posthog.com, one run in ten.
AIDER = ["--message", "say hi", "--yes-always", "--no-git", "--no-show-model-warnings",
         "--no-pretty", "--no-analytics"]
OTHER_PATH = """\
import json, os, urllib.request, urllib.error
req = urllib.request.Request("https://api.openai.com/v1/files",
                             headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
try:
    print(urllib.request.urlopen(req, timeout=20).status)
except urllib.error.HTTPError as e:
    print(e.code, json.loads(e.read())["error"])
"""


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeInference]:
    fake = FakeInference(tmp_path_factory.mktemp("fake"), api_key=KEY).start()
    try:
        yield fake
    finally:
        fake.stop()


def _gateway(fake: FakeInference, work: Path, policy: str) -> GatewayThread:
    (work / "policies").mkdir(parents=True)
    (work / "policies" / "agent.yaml").write_text(policy)
    secrets = work / "secrets.yaml"
    secrets.write_text(f"provider-key: {KEY}\n")
    secrets.chmod(0o600)
    return GatewayThread(work, {
        "network": {"upstream_ca": str(fake.ca_path),
                    "resolve": {host: f"127.0.0.1:{fake.port}" for host in HOSTS}},
        "secrets": {"store": "file", "path": str(secrets)},
        "refusals": {"inside_tls": True}})


def _sandbox(gw: GatewayThread, work: Path, name: str) -> Sandbox:
    token = gw.mint("agent", sandbox=name)
    return Sandbox.from_cli(work / "homes" / name, token=token, proxy=gw.proxy,
                            ca_bundle=gw.ca_cert, node_preload=Path("none"),
                            config=work / "gateway.yaml")


def _aider(box: Sandbox, model: str) -> str:
    out = box.run([str(aider_cli()), *AIDER, "--model", model], timeout=120)
    shown = out.stdout + out.stderr
    assert KEY not in shown
    return " ".join(shown.split()) if out.returncode == 0 else f"exit {out.returncode}: {shown}"


def _settled(gw: GatewayThread, sandbox: str) -> list[dict[str, Any]]:
    """The sandbox's audit lines once no new one has come for half a second (a line is
    written a moment after its response is relayed; Aider's last calls run beside the
    model call)."""
    lines: list[dict[str, Any]] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = [r for r in gw.audit.records() if r.get("sandbox") == sandbox]
        if now and len(now) == len(lines):
            return now
        lines = now
        time.sleep(0.5)
    return lines


def _calls(records: list[dict[str, Any]]) -> set[tuple[str, str, str, str]]:
    return {(r["decision"], r["method"], r["host"], r["path"]) for r in records}


@pytest.mark.timeout(420)  # three Aider runs (each up to 120 s on a loaded machine)
def test_aider_learned_then_enforced(fake: FakeInference, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    # 1. learn mode: Aider's calls all go (the model call with the real key injected)
    gw = _gateway(fake, tmp_path / "learning", LEARNING)
    try:
        shown = _aider(_sandbox(gw, tmp_path / "learning", "learner"), "gpt-4.1")
        learned_lines = _settled(gw, "learner")
    finally:
        gw.stop()
    assert REPLY in shown, shown[-3000:]
    assert not [r for r in learned_lines if r["decision"] != "report"], [
        (r["method"], r["host"], r["path"], r["error"], r["reason"]) for r in learned_lines]
    assert {("report", "POST", "api.openai.com", "/v1/chat/completions"),
            ("report", "GET", "pypi.org", "/pypi/aider-chat/json")} <= _calls(learned_lines)
    chat = [r for r in learned_lines if r["path"] == "/v1/chat/completions"]
    assert {(r["credential"], tuple(r["models"])) for r in chat} == {("openai", ("gpt-4.1",))}

    # 2. policy learn, with its replay proof
    audit = tmp_path / "audit.jsonl"
    audit.write_text("".join(json.dumps(r) + "\n" for r in learned_lines))
    out = tmp_path / "learned.yaml"
    code = cli_main(["policy", "learn", str(audit), "--dir",
                     str(tmp_path / "learning" / "policies"), "--out", str(out), "--replay"])
    err = capsys.readouterr().err
    assert code == 0 and "replay proof: " in err and ": OK" in err, err
    learned = yaml.safe_load(out.read_text())
    # The price map and the update check fall to presets that cover them (wider than the
    # two paths: policy learn's rule 2, docs/policies.md); the model call is its own rule.
    assert learned["extends"] == ["service/github-read", "service/pypi"], learned
    assert learned["credentials"] == {"openai": {"preset": "openai", "secret": "provider-key"}}
    openai = [r for r in learned["egress"] if r["host"] == "api.openai.com"]
    assert openai == [{"host": "api.openai.com", "methods": ["POST"],
                       "paths": ["/v1/chat/completions"], "credential": "openai",
                       "models": ["gpt-4.1"]}], learned

    # 3. enforcing the learned policy: the same command works; what it never did is refused
    gw = _gateway(fake, tmp_path / "enforcing", out.read_text())
    try:
        box = _sandbox(gw, tmp_path / "enforcing", "enforced")
        again = _aider(box, "gpt-4.1")
        enforced = _settled(gw, "enforced")
        other_model = _aider(_sandbox(gw, tmp_path / "enforcing", "other-model"), "gpt-4o")
        other_path = box.run([sys.executable, "-c", OTHER_PATH], timeout=60)
        refused = gw.audit.wait_for(lambda r: r.get("decision") == "deny")
    finally:
        gw.stop()
    assert REPLY in again, again[-3000:]
    chats = [r for r in fake.requests if r.path == "/v1/chat/completions"]
    assert chats and all(r.headers["authorization"] == f"Bearer {KEY}" for r in chats)
    assert not [r for r in enforced if r["decision"] != "allow"], [
        (r["method"], r["host"], r["path"], r["error"], r["reason"]) for r in enforced]
    assert {(m, h, p) for _, m, h, p in _calls(enforced)} == {
        (m, h, p) for _, m, h, p in _calls(learned_lines)}
    assert 'model_not_allowed: model "gpt-4o" is not allowed by rule' in other_model, \
        other_model[-3000:]
    assert other_path.stdout.split()[0] == "403", other_path.stdout + other_path.stderr
    assert {(r["sandbox"], r["host"], r["path"], r["error"]) for r in refused} == {
        ("other-model", "api.openai.com", "/v1/chat/completions", "model_not_allowed"),
        ("enforced", "api.openai.com", "/v1/files", "policy_denied")}, refused
