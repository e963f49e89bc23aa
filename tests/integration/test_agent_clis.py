"""The agent CLIs people run, as released on npm (Codex CLI, Claude Code), configured only
by `sandbox-gateway env` output and the shipped agent presets, against the stand-in
provider (tests/fakes/inference.py) through the real gateway with its default refusals
inside TLS.

Each run asserts what a user needs: the agent's answer, the real key upstream and never
in the sandbox (its environment, output or files), the token never upstream, the model
call metered on its audit line, telemetry refused by the preset's rule, and a refusal's
reason printed by the agent itself.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fakes.inference import FakeInference
from helpers.clock import far_window
from helpers.dlp_corpus import fake
from helpers.gateway import GatewayThread
from helpers.node_clients import agent_clis
from helpers.python_clients import aider_cli
from helpers.sandbox import Sandbox

from gateway.cli import main as cli_main

PROVIDER_KEY = "sk-agents-provider-key-0123456789"
REPLY = "The fake provider answers."
HOSTS = ("api.openai.com", "api.anthropic.com", "generativelanguage.googleapis.com",
         "chatgpt.com", "ab.chatgpt.com", "github.com", "api.github.com",
         "raw.githubusercontent.com", "models.opencode.ai")
# The first policy checks every request for credentials the gateway did not issue (issue
# 43, `dlp:`): each agent's real traffic (system prompts, tool definitions, code, tool
# call ids, SDK heads) passes it untouched. (The rules' line numbers below count it.)
POLICIES = """\
version: v1
name: agents
extends: [agent/codex, agent/claude-code, agent/gemini-cli]
dlp: {action: refuse}
credentials:
  openai: {preset: openai, secret: provider-key}
  anthropic: {preset: anthropic, secret: provider-key}
  gemini: {preset: gemini, secret: provider-key}
---
version: v1
name: narrow
extends: [agent/codex, agent/claude-code, agent/gemini-cli]
egress:
  - host: api.openai.com
    credential: openai
    models: ["gpt-4.1*"]
  - host: api.anthropic.com
    credential: anthropic
    models: ["claude-haiku-*"]
  - host: generativelanguage.googleapis.com
    credential: gemini
    models: ["gemini-2.5-*"]
---
version: v1
name: aider
extends: [agent/aider]
egress:
  - host: api.openai.com
    credential: openai
    models: ["gpt-4.1*"]
  - host: api.anthropic.com
    credential: anthropic
    models: ["claude-2*"]
---
version: v1
name: opencode
extends: [agent/opencode]
egress:
  - host: api.anthropic.com
    credential: anthropic
    models: ["claude-*"]
  - host: api.openai.com
    credential: openai
    models: ["gpt-*"]
"""
# Budgets used up by any model call (one token): final until the window ends, far away.
SPENT = """\
---
version: v1
name: spent
extends: [agent/codex, agent/claude-code]
budgets:
  - {{name: spent, per: sandbox, window: {window}, tokens: 1}}
"""
# Codex's HTTP transport: a provider entry without WebSockets (a user's config.toml would
# hold the same); the base URL is the real one, the gateway is still only in the env.
HTTP_PROVIDER = ["-c", 'model_provider="oai"', "-c",
                 'model_providers.oai={name="oai",base_url="https://api.openai.com/v1",'
                 'env_key="CODEX_API_KEY",wire_api="responses",supports_websockets=false}']


@dataclass
class Agents:
    gw: GatewayThread
    fake: FakeInference
    root: Path
    tools: dict[str, Path]
    preload: Path

    def sandbox(self, name: str, policy: str = "agents") -> tuple[Sandbox, str]:
        token = self.gw.mint(policy, sandbox=name)
        box = Sandbox.from_cli(self.root / "homes" / name, token=token, proxy=self.gw.proxy,
                               ca_bundle=self.gw.ca_cert, node_preload=self.preload,
                               config=self.root / "gateway.yaml")
        return box, token

    def lines(self, sandbox: str) -> list[dict[str, Any]]:
        return [r for r in self.gw.audit.records() if r.get("sandbox") == sandbox]


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agents]:
    tools = agent_clis()
    root = tmp_path_factory.mktemp("agents")
    fake = FakeInference(root / "fake", api_key=PROVIDER_KEY, websocket=True).start()
    try:
        (root / "policies").mkdir()
        (root / "policies" / "agents.yaml").write_text(
            POLICIES + SPENT.format(window=far_window()))
        secrets = root / "secrets.yaml"
        secrets.write_text(f"provider-key: {PROVIDER_KEY}\n")
        secrets.chmod(0o600)
        gw = GatewayThread(root, {
            "network": {"upstream_ca": str(fake.ca_path),
                        "resolve": {host: f"127.0.0.1:{fake.port}" for host in HOSTS}},
            "secrets": {"store": "file", "path": str(secrets)},
            "refusals": {"inside_tls": True}})
        preload = root / "node-proxy-preload.mjs"  # the Gemini CLI runs on Node 20
        assert cli_main(["node-preload", "-o", str(preload)]) == 0
        try:
            yield Agents(gw, fake, root, tools, preload)
        finally:
            gw.stop()
    finally:
        fake.stop()


def _no_key_in_the_sandbox(box: Sandbox, *outputs: str) -> None:
    """The real key reached neither the agent's environment, its output nor its files."""
    assert PROVIDER_KEY not in json.dumps(box.variables)
    for text in outputs:
        assert PROVIDER_KEY not in text
    for path in box.home.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert PROVIDER_KEY.encode() not in path.read_bytes(), path


def _upstream_saw(fake: FakeInference, seen_before: int, token: str) -> list[Any]:
    """This run's requests at the stand-in: the model calls carried the real key, no
    request carried the token."""
    mine = fake.requests[seen_before:]
    assert token not in json.dumps([r.headers for r in mine])
    model_calls = [r for r in mine if r.path.split("?")[0] in (
                   "/v1/responses", "/v1/messages", "/v1/chat/completions")
                   or "/models/gemini" in r.path]
    assert model_calls
    for request in model_calls:
        assert PROVIDER_KEY in (request.headers.get("authorization", "") +
                                request.headers.get("x-api-key", "") +
                                request.headers.get("x-goog-api-key", ""))
    return model_calls


def _tokens(line: dict[str, Any]) -> int:
    """The input tokens metered on an audit line (0: none)."""
    return int((line.get("usage") or {}).get("input_tokens") or 0)


def _metered(lines: list[dict[str, Any]], host: str, calls: int = 1) -> dict[str, Any]:
    metered = [r for r in lines if r["host"] == host and _tokens(r)]
    assert len(metered) == calls, lines
    for call in metered:
        assert call["decision"] == "allow" and call["credential"] in (
            "openai", "anthropic", "gemini")
        assert call["usage"]["input_tokens"] > 0 and call["usage"]["output_tokens"] == 4
    return metered[-1]


@pytest.mark.parametrize("transport", ["websocket", "http"])
def test_codex_exec(agents: Agents, transport: str) -> None:
    name = f"codex-{transport}"
    box, token = agents.sandbox(name)
    seen = len(agents.fake.requests)
    argv = [str(agents.tools["codex"]), "exec", "--skip-git-repo-check",
            *(HTTP_PROVIDER if transport == "http" else []), "say hi"]
    out = box.run(argv, timeout=90)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == REPLY
    _no_key_in_the_sandbox(box, out.stdout, out.stderr)
    calls = _upstream_saw(agents.fake, seen, token)
    assert {c.method for c in calls} == ({"GET"} if transport == "websocket" else {"POST"})
    lines = agents.lines(name)
    call = _metered(lines, "api.openai.com")
    assert call["status"] == (101 if transport == "websocket" else 200)
    assert call["rule"] == "agent/codex.yaml:13"
    _preset_refusals(lines, out.stderr, required=False)


def _preset_refusals(lines: list[dict[str, Any]], stderr: str, *, required: bool) -> None:
    """Telemetry is refused by the preset (the tunnel, answered inside TLS), and so is
    the ChatGPT-account model list, whose reason Codex prints. (Both are sent in the
    background: a run that ends in a second may end before them; the metrics only
    leave at a turn's end.)"""
    telemetry = [r for r in lines if r["host"] == "ab.chatgpt.com"]
    models = [r for r in lines if r.get("path") == "/backend-api/codex/models"]
    assert {(r["error"], r["rule"]) for r in telemetry} <= {
        ("policy_denied", "agent/codex.yaml:38")}, telemetry
    assert {(r["error"], r["rule"]) for r in models} <= {
        ("policy_denied", "agent/codex.yaml:21")}, models
    if required or models:
        assert models, lines
        assert "Codex's ChatGPT-account endpoints need a ChatGPT sign-in" in stderr


def test_codex_prints_a_model_refusal(agents: Agents) -> None:
    """A model the policy does not allow: refused on the WebSocket and then on HTTP (Codex
    falls back, 5 tries each), and Codex's last words are the gateway's reason."""
    name = "codex-refused"
    box, _ = agents.sandbox(name, policy="narrow")
    out = box.run([str(agents.tools["codex"]), "exec", "--skip-git-repo-check", "say hi"],
                  timeout=120)
    assert out.returncode != 0
    assert 'model_not_allowed: model "gpt-6.1-sol" is not allowed by rule ' \
           "policies/agents.yaml:14 (models: gpt-4.1*)" in out.stderr, out.stderr[-3000:]
    lines = agents.lines(name)
    # Each response.create on the WebSocket, then each POST, refused; nothing reached the
    # stand-in but the WebSocket upgrades (no model call: no usage on any line).
    refused = [r for r in lines if r["host"] == "api.openai.com" and r["error"]]
    assert refused and {r["error"] for r in refused} == {"model_not_allowed"}
    assert {r["method"] for r in refused} == {"GET", "POST"}
    assert not [r for r in lines if _tokens(r)]
    _preset_refusals(lines, out.stderr, required=True)
    _no_key_in_the_sandbox(box, out.stdout, out.stderr)


@pytest.mark.parametrize("transport", ["websocket", "http"])
def test_codex_stops_at_once_on_a_used_up_budget(agents: Agents, transport: str) -> None:
    """A budget used up until its window ends: Codex stops at once on the provider's
    quota answer (429 insufficient_quota), where a rate limit with a Retry-After of hours
    had its HTTP transport wait it out silently (past this test's two minutes). Codex
    prints its own words for a spent quota, not the message; the audit line has it."""
    name = f"codex-spent-{transport}"
    box, _ = agents.sandbox(name, policy="spent")
    seen = len(agents.fake.requests)
    started = time.monotonic()
    out = box.run([str(agents.tools["codex"]), "exec", "--skip-git-repo-check",
                   *(HTTP_PROVIDER if transport == "http" else []), "say hi"], timeout=120)
    assert out.returncode != 0 and time.monotonic() - started < 30
    assert "Quota exceeded. Check your plan and billing details." in out.stderr, \
        out.stderr[-3000:]
    refused = [r for r in agents.lines(name) if r.get("error") == "budget_exceeded"]
    method = "GET" if transport == "websocket" else "POST"  # (the upgrade, or the call)
    assert refused and {(r["method"], r["path"], r["status"]) for r in refused} == {
        (method, "/v1/responses", 429)}
    assert len(refused) <= 2  # (no retry loop: one try per transport Codex opens)
    assert 'budget "spent" (policies/agents.yaml:' in refused[0]["reason"]
    assert not [r for r in agents.fake.requests[seen:] if r.method == "POST"]
    assert not [r for r in agents.lines(name) if _tokens(r)]  # no model call was made
    _no_key_in_the_sandbox(box, out.stdout, out.stderr)


def test_claude_code_stops_at_once_on_a_used_up_budget(agents: Agents) -> None:
    """Claude Code retries a 429 up to ten times; a used-up budget is Anthropic's answer
    to a spent credit balance (400 invalid_request_error), which it shows and stops on."""
    name = "claude-spent"
    box, _ = agents.sandbox(name, policy="spent")
    started = time.monotonic()
    out = box.run([str(agents.tools["claude"]), "-p", "say hi"], timeout=90)
    assert out.returncode != 0 and time.monotonic() - started < 30
    assert 'API Error: 400 budget_exceeded: budget "spent" (policies/agents.yaml:' in \
        out.stdout, out.stdout[-3000:]
    refused = [r for r in agents.lines(name) if r.get("error") == "budget_exceeded"]
    assert refused and {(r["path"], r["status"]) for r in refused} == {("/v1/messages", 400)}
    assert len(refused) <= 2
    _no_key_in_the_sandbox(box, out.stdout, out.stderr)


def test_claude_code_print(agents: Agents) -> None:
    name = "claude-print"
    box, token = agents.sandbox(name)
    seen = len(agents.fake.requests)
    out = box.run([str(agents.tools["claude"]), "-p", "say hi"], timeout=90)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert out.stdout.strip() == REPLY
    _no_key_in_the_sandbox(box, out.stdout, out.stderr)
    _upstream_saw(agents.fake, seen, token)
    lines = agents.lines(name)
    assert _metered(lines, "api.anthropic.com")["rule"] == "agent/claude-code.yaml:12"
    by_path = {r["path"]: r for r in lines if r.get("path")}
    # Settings go with the key on their own rule; telemetry is refused by the preset.
    assert by_path["/api/claude_code/settings"]["credential"] == "anthropic"
    assert by_path["/api/claude_code/settings"]["rule"] == "agent/claude-code.yaml:16"
    logging = by_path["/api/event_logging/v2/batch"]
    assert (logging["error"], logging["rule"]) == ("policy_denied", "agent/claude-code.yaml:31")
    assert not [r for r in lines if r.get("error") not in (None, "policy_denied")], lines


def test_claude_code_prints_a_secret_in_its_prompt_refused(agents: Agents) -> None:
    """The control for the detection every test above passes: a GitHub token the agent
    puts in its prompt (as a prompt-injected agent would) is refused before the provider
    sees it, and Claude Code prints the gateway's reason; the audit line names the
    detector, never the value."""
    name = "claude-secret"
    box, _ = agents.sandbox(name)
    secret = fake("github").text
    seen = len(agents.fake.requests)
    out = box.run([str(agents.tools["claude"]), "-p", f"push with the token {secret}"],
                  timeout=90)
    assert out.returncode != 0
    assert "403 secret_detected" in out.stdout, out.stdout[-3000:]
    assert secret not in json.dumps(agents.fake.requests[seen:], default=str)
    refused = [r for r in agents.lines(name) if r.get("error") == "secret_detected"]
    assert refused and {f["detector"] for r in refused for f in r["dlp"]} == {"github"}
    assert secret not in json.dumps(refused)


def test_claude_code_prints_a_model_refusal(agents: Agents) -> None:
    name = "claude-refused"
    box, _ = agents.sandbox(name, policy="narrow")
    out = box.run([str(agents.tools["claude"]), "-p", "say hi"], timeout=90)
    assert out.returncode != 0
    assert ("403 model_not_allowed: model \"claude-opus-5-5\" is not allowed by rule "
            "policies/agents.yaml:17 (models: claude-haiku-*)") in out.stdout, out.stdout
    _no_key_in_the_sandbox(box, out.stdout, out.stderr)


def test_gemini_cli_print(agents: Agents) -> None:
    """The Gemini CLI (JavaScript, on Node 20 through the env's preload): its model router
    asks a small model for a JSON score, then the chosen model streams the answer."""
    name = "gemini-print"
    box, token = agents.sandbox(name)
    seen = len(agents.fake.requests)
    out = box.run([str(agents.tools["gemini"]), "--skip-trust", "-p", "say hi"], timeout=90)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert out.stdout.strip() == REPLY
    _no_key_in_the_sandbox(box, out.stdout, out.stderr)
    assert len(_upstream_saw(agents.fake, seen, token)) == 2
    lines = agents.lines(name)
    assert _metered(lines, "generativelanguage.googleapis.com", calls=2)["rule"] == \
        "agent/gemini-cli.yaml:12"
    assert {(r["error"], r["rule"]) for r in lines if r["host"] == "play.googleapis.com"} <= {
        ("policy_denied", "agent/gemini-cli.yaml:16")}


def test_gemini_cli_prints_a_model_refusal(agents: Agents) -> None:
    name = "gemini-refused"
    box, _ = agents.sandbox(name, policy="narrow")
    out = box.run([str(agents.tools["gemini"]), "--skip-trust", "-p", "say hi"], timeout=90)
    assert out.returncode != 0
    assert ('"code":403,"message":"model_not_allowed: model \\"gemini-3.1-pro-preview\\" is '
            "not allowed by rule policies/agents.yaml:20 (models: gemini-2.5-*)") in out.stderr, \
        out.stderr[-3000:]
    _no_key_in_the_sandbox(box, out.stdout, out.stderr)


@pytest.mark.parametrize("provider", ["anthropic/claude-sonnet-4-5", "openai/gpt-4.1"])
def test_opencode_run(agents: Agents, provider: str) -> None:
    """opencode with the provider's rule beside agent/opencode (the answer, and a title
    call in the background: each metered)."""
    name = f"opencode-{provider.split('/')[0]}"
    box, token = agents.sandbox(name, policy="opencode")
    seen = len(agents.fake.requests)
    out = box.run([str(agents.tools["opencode"]), "run", "-m", provider, "say hi"], timeout=90)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert out.stdout.strip() == REPLY
    _no_key_in_the_sandbox(box, out.stdout, out.stderr)
    _upstream_saw(agents.fake, seen, token)
    host = "api.anthropic.com" if provider.startswith("anthropic") else "api.openai.com"
    # The answer and the session title (a small model, in the background): both metered.
    deadline = time.monotonic() + 10
    while len(calls := [r for r in agents.lines(name) if r["host"] == host]) < 2:
        assert time.monotonic() < deadline, calls
        time.sleep(0.05)
    assert all(r["decision"] == "allow" and _tokens(r) for r in calls), calls


def test_aider_message(agents: Agents) -> None:
    """Aider (from PyPI) with the provider's rule beside agent/aider: the answer, metered;
    LiteLLM's price map allowed (the stand-in has none: a 404 it falls back from); the
    update check refused by the preset, which aider shrugs off."""
    name = "aider"
    box, token = agents.sandbox(name, policy="aider")
    seen = len(agents.fake.requests)
    out = box.run([str(aider_cli()), "--message", "say hi", "--yes-always", "--no-git",
                   "--model", "gpt-4.1", "--no-show-model-warnings", "--no-pretty"],
                  timeout=120)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert REPLY in out.stdout
    _no_key_in_the_sandbox(box, out.stdout, out.stderr)
    _upstream_saw(agents.fake, seen, token)
    lines = agents.lines(name)
    assert _metered(lines, "api.openai.com")["rule"] == "policies/agents.yaml:28"
    prices = [r for r in lines if r["host"] == "raw.githubusercontent.com"]
    assert prices and {(r["decision"], r["rule"], r["status"]) for r in prices} == {
        ("allow", "agent/aider.yaml:11", 404)}
    update = [r for r in lines if r["host"] == "pypi.org"]
    assert update and {(r["error"], r["rule"]) for r in update} == {
        ("policy_denied", "agent/aider.yaml:15")}


@pytest.mark.parametrize("agent", ["aider", "opencode"])
def test_aider_and_opencode_print_a_model_refusal(agents: Agents, agent: str) -> None:
    """A model the policy does not allow: each prints the gateway's reason and stops
    (LiteLLM, so Aider, retries an OpenAI error for a minute unless it is an
    invalid_request_error, which refusals are; an Anthropic 403 it retries whatever the
    body says: see docs/clients.md)."""
    name = f"{agent}-refused"
    if agent == "aider":  # `narrow` allows gpt-4.1* only
        box, _ = agents.sandbox(name, policy="narrow")
        argv = [str(aider_cli()), "--message", "say hi", "--yes-always", "--no-git",
                "--model", "gpt-4o", "--no-show-model-warnings", "--no-pretty"]
        host, model, rule = "api.openai.com", "gpt-4o", "policies/agents.yaml:14 (models: gpt-4.1*)"
    else:  # `aider` allows claude-2* only on api.anthropic.com
        box, _ = agents.sandbox(name, policy="aider")
        argv = [str(agents.tools["opencode"]), "run", "-m", "anthropic/claude-sonnet-4-5",
                "say hi"]
        host, model, rule = ("api.anthropic.com", "claude-sonnet-4-5",
                             "policies/agents.yaml:31 (models: claude-2*)")
    started = time.monotonic()
    out = box.run(argv, timeout=90)
    assert time.monotonic() - started < 30
    shown = out.stdout + out.stderr
    assert f'model_not_allowed: model "{model}" is not allowed by rule {rule}' in \
        " ".join(shown.split()), shown[-3000:]  # (aider wraps its lines)
    refused = [r for r in agents.lines(name) if r["host"] == host]
    assert refused and {r["error"] for r in refused} == {"model_not_allowed"}
    _no_key_in_the_sandbox(box, out.stdout, out.stderr)


def test_the_presets_say_what_they_bring(agents: Agents) -> None:
    assert cli_main(["policy", "check", str(agents.root / "policies")]) == 0


def test_an_agent_that_outlives_its_token_is_told_so(agents: Agents) -> None:
    """A session that read its key once and outlived the token: each call is refused
    with `token_expired` and the agent prints it, at once (never a hang, never upstream)."""
    name = "claude-expired"
    token = agents.gw.mint("agents", sandbox=name, ttl=2)
    box = Sandbox.from_cli(agents.root / "homes" / name, token=token, proxy=agents.gw.proxy,
                           ca_bundle=agents.gw.ca_cert, node_preload=Path("none"),
                           config=agents.root / "gateway.yaml")
    time.sleep(max(0.0, json.loads(_payload(token))["exp"] - time.time() + 0.2))
    seen = len(agents.fake.requests)
    started = time.monotonic()
    out = box.run([str(agents.tools["claude"]), "-p", "say hi"], timeout=60)
    assert out.returncode != 0 and time.monotonic() - started < 30
    assert "API Error: 407 token_expired: the token expired at " in out.stdout, out.stdout
    assert len(agents.fake.requests) == seen
    assert {r["error"] for r in agents.lines(name)} == {"token_expired"}


def _payload(token: str) -> bytes:
    part = token.split(".")[1]
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))
