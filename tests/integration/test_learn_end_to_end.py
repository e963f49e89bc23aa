"""Learn mode to a reviewed policy, end to end: a sandbox under `mode: learn` runs real
clients (git clone, pip install, an OpenAI call through the credential, an internal API)
through the real gateway to local servers answering for the real names; `policy learn`
turns the audit lines into a policy (presets for GitHub and PyPI, own rules for the rest,
the model listed, the credential named), proves it by replay and proposes it as a git
branch; a gateway enforcing the learned policy then lets the same clients through and
refuses what they never did."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
import yaml
from fakes.git_server import make_repo, start_git_server
from fakes.inference import FakeInference
from fakes.pypi_index import make_wheel
from fakes.tls_http import Head, Recorder, TLSServer, serve_handler, serve_wsgi
from helpers.gateway import GatewayThread
from helpers.sandbox import Sandbox
from helpers.tls import LocalCA
from integration.test_service_presets import PKG, _pypi_app

from gateway.cli import main as cli_main

KEY = "sk-learn-real-key-0123456789abcdef"
LEARNING = """\
version: v1
name: agent
mode: learn
egress: []
credentials:
  openai: {preset: openai, secret: openai-key}
"""
API = "api.internal.example"
API_CALLS = [("GET", "/v1/items/123"), ("GET", "/v1/items/456"),
             ("GET", "/v1/items/789/comments"), ("GET", "/v1/status"), ("POST", "/v1/items"),
             ("GET", "/docs/a"), ("GET", "/docs/b"), ("GET", "/docs/c"), ("GET", "/docs/d")]
CLIENT = """\
import json, os, sys, urllib.request
def call(method, url, body=None, headers=None):
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError as e:
        return str(e)
out = {}
for method, path in json.loads(sys.argv[1]):
    out[method + " " + path] = call(method, "https://%s" % sys.argv[2] + path,
                                    b"{}" if method == "POST" else None)
body = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]})
out["openai"] = call("POST", "https://api.openai.com/v1/chat/completions", body.encode(),
                     {"Authorization": "Bearer " + os.environ["SGW_TOKEN"],
                      "Content-Type": "application/json"})
out["metadata"] = call("GET", "http://169.254.169.254/latest/meta-data/")
print(json.dumps(out))
"""


class _Api(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self) -> None:
        self.server.recorder.add(Head(self.command, self.path, {}))  # type: ignore[attr-defined]
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_GET = do_POST = do_DELETE = _answer


@dataclass
class Lab:
    root: Path
    ca: LocalCA
    resolve: dict[str, str]
    upstream_ca: Path


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    root = tmp_path_factory.mktemp("learn")
    ca = LocalCA.create(root / "ca", name="learn upstream CA")
    make_repo(root / "git", "octo/hello", "from-github\n")
    wheel = make_wheel(root / "wheels", PKG, "1.0.0", "from-pypi")
    fake = FakeInference(root / "fake", api_key=KEY).start()
    servers: list[TLSServer] = [
        start_git_server(root / "git", ca, ["github.com"]),
        serve_wsgi(_pypi_app(wheel), ca.server_context(
            root / "wheels", ["pypi.org", "files.pythonhosted.org"]), Recorder()),
        serve_handler(_Api, ca.server_context(root, [API]), Recorder())]
    git, pypi, api = servers
    upstream_ca = root / "upstream-ca.pem"
    upstream_ca.write_bytes(ca.cert_path.read_bytes() + fake.ca_path.read_bytes())
    try:
        yield Lab(root, ca, {"github.com": f"127.0.0.1:{git.port}",
                             "pypi.org": f"127.0.0.1:{pypi.port}",
                             "files.pythonhosted.org": f"127.0.0.1:{pypi.port}",
                             API: f"127.0.0.1:{api.port}",
                             "api.openai.com": f"127.0.0.1:{fake.port}"}, upstream_ca)
    finally:
        for server in servers:
            server.stop()
        fake.stop()


def _gateway(lab: Lab, workdir: Path, policy: str) -> GatewayThread:
    (workdir / "policies").mkdir(parents=True)
    (workdir / "policies" / "agent.yaml").write_text(policy)
    secrets = workdir / "secrets.yaml"
    secrets.write_text(f"openai-key: {KEY}\n")
    secrets.chmod(0o600)
    return GatewayThread(workdir, {"network": {"upstream_ca": str(lab.upstream_ca),
                                               "resolve": lab.resolve},
                                   "secrets": {"store": "file", "path": str(secrets)}})


def _run_clients(gw: GatewayThread, workdir: Path, sandbox: str,
                 calls: list[tuple[str, str]]) -> dict[str, Any]:
    """git clone, pip install and the script's calls, in one sandbox; what each got."""
    token = gw.mint("agent", sandbox=sandbox)
    box = Sandbox.from_cli(workdir / "homes" / sandbox, token=token, proxy=gw.proxy,
                           ca_bundle=gw.ca_cert, node_preload=Path("none"),
                           config=workdir / "gateway.yaml")
    clone = box.run(["git", "clone", "-q", "https://github.com/octo/hello.git", "clone"],
                    timeout=60)
    pip = box.run([sys.executable, "-m", "pip", "install", "--no-cache-dir", "--retries", "0",
                   "--timeout", "10", "--disable-pip-version-check", "--target",
                   str(box.home / "site"), "--index-url", "https://pypi.org/simple/", PKG],
                  timeout=120)
    script = box.run([sys.executable, "-c", CLIENT, json.dumps(calls), API], timeout=120,
                     SGW_TOKEN=token)
    assert script.returncode == 0, script.stderr
    return {"clone": clone.returncode, "pip": pip.returncode, **json.loads(script.stdout)}


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=cwd, check=True, capture_output=True, text=True,
                          timeout=30).stdout


def test_learn_then_enforce(lab: Lab, capsys: pytest.CaptureFixture[str]) -> None:
    # 1. learn mode: everything the clients do goes, what is never allowed does not
    work = lab.root / "learning"
    gw = _gateway(lab, work, LEARNING)
    try:
        got = _run_clients(gw, work, "learner", API_CALLS)
        lines = gw.audit.wait_for(lambda r: r.get("host") == "169.254.169.254")
        records = gw.audit.records()
    finally:
        gw.stop()
    assert got["clone"] == 0 and got["pip"] == 0, got
    assert all(got[f"{m} {p}"] == 200 for m, p in API_CALLS), got
    assert got["openai"] == 200, got
    assert got["metadata"] != 200 and lines and lines[0]["decision"] == "deny", (got, lines)
    chat = [r for r in records if r["path"] == "/v1/chat/completions"]
    assert chat and chat[0]["credential"] == "openai" and chat[0]["models"] == [
        "gpt-4o-mini"] and chat[0]["decision"] == "report", chat

    # 2. policy learn: the file, its replay proof, a branch in the policies checkout
    audit = lab.root / "audit.jsonl"
    audit.write_text("".join(json.dumps(r) + "\n" for r in records))
    policies = work / "policies"
    _git(policies, "init", "-q", "-b", "main")
    _git(policies, "add", ".")
    _git(policies, "commit", "-q", "-m", "learning")
    out = lab.root / "learned.yaml"
    code = cli_main(["policy", "learn", str(audit), "--dir", str(policies), "--out", str(out),
                     "--replay", "--propose", "--patch-dir", str(lab.root)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "replay proof: " in err and ": OK" in err, err
    learned = yaml.safe_load(out.read_text())
    assert learned["extends"] == ["service/github-read", "service/pypi"], learned
    assert "mode" not in learned
    assert learned["credentials"] == {"openai": {"preset": "openai", "secret": "openai-key"}}
    rules = [(r["host"], r.get("methods"), r.get("paths"), r.get("credential"),
              r.get("models")) for r in learned["egress"]]
    assert rules == [
        ("api.internal.example", ["GET"],
         ["/docs/**", "/v1/items/*", "/v1/items/*/comments", "/v1/status"], None, None),
        ("api.internal.example", ["POST"], ["/v1/items"], None, None),
        ("api.openai.com", ["POST"], ["/v1/chat/completions"], "openai", ["gpt-4o-mini"]),
    ], rules
    assert "refused before, allowed now" not in err
    assert "branch: sandbox-gateway/learned-agent-" in err, err
    branch = err.split("branch: ")[1].split()[0]
    assert _git(policies, "show", f"{branch}:agent.yaml") == out.read_text()
    assert (policies / "agent.yaml").read_text() == LEARNING  # the checkout is untouched
    assert cli_main(["policy", "check", str(policies)]) == 0

    # 3. enforcing the learned policy: the same clients go, what they never did does not
    work2 = lab.root / "enforcing"
    gw = _gateway(lab, work2, out.read_text())
    try:
        calls = [*API_CALLS, ("GET", "/v1/admin"), ("POST", "/v1/status"),
                 ("DELETE", "/v1/items/123")]
        got = _run_clients(gw, work2, "enforced", calls)
        records = gw.audit.records()
    finally:
        gw.stop()
    assert got["clone"] == 0 and got["pip"] == 0, got
    assert all(got[f"{m} {p}"] == 200 for m, p in API_CALLS), got
    assert got["openai"] == 200, got
    assert [got["GET /v1/admin"], got["POST /v1/status"], got["DELETE /v1/items/123"]] == [
        403, 403, 403], got
    assert got["metadata"] != 200
    assert not [r for r in records if r["decision"] == "report"]


def test_config_learn_puts_an_enforcing_policy_in_learn_mode(lab: Lab) -> None:
    """`run --learn` sets `learn: true`: the policy file says enforce, the run learns."""
    work = lab.root / "learn-flag"
    (work / "policies").mkdir(parents=True)
    (work / "policies" / "agent.yaml").write_text("version: v1\nname: agent\negress: []\n")
    gw = GatewayThread(work, {"learn": True, "network": {
        "upstream_ca": str(lab.upstream_ca), "resolve": lab.resolve}})
    try:
        token = gw.mint("agent", sandbox="flagged")
        box = Sandbox.from_cli(work / "homes" / "flagged", token=token, proxy=gw.proxy,
                               ca_bundle=gw.ca_cert, node_preload=Path("none"),
                               config=work / "gateway.yaml")
        script = box.run([sys.executable, "-c", CLIENT, json.dumps([("GET", "/v1/x")]), API],
                         timeout=60, SGW_TOKEN=token)
        got = json.loads(script.stdout)
        lines = gw.audit.wait_for(lambda r: r.get("path") == "/v1/x")
    finally:
        gw.stop()
    assert got["GET /v1/x"] == 200, got
    assert [(r["decision"], r["path_taken"]) for r in lines] == [("report", "intercept")]
