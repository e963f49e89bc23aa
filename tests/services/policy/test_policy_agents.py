"""Agent presets (`extends: [agent/codex]`): each shipped preset loads; the calls the
real agents were seen making are decided by the rule meant for them (a settings or
telemetry call never by the provider's model rule); the telemetry switch; errors."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from gateway.cli import main as cli_main
from gateway.core.policy import Request, decide
from gateway.services.policy import PolicyError, load_policy_text
from gateway.services.policy.agents import known_agents

CREDENTIALS = """\
credentials:
  openai: {preset: openai, secret: k}
  anthropic: {preset: anthropic, secret: k}
  gemini: {preset: gemini, secret: k}
"""


def _policy(extends: str, egress: str = ""):  # type: ignore[no-untyped-def]
    text = f"version: v1\nname: p\nextends: {extends}\n{egress}{CREDENTIALS}"
    return load_policy_text("policies/p.yaml", text).policies["p"]


def _decide(policy, host: str, method: str | None = None,  # type: ignore[no-untyped-def]
            path: str | None = None):
    return decide(policy, Request(host=host, port=443, scheme="https", method=method,
                                  path=path))


def test_the_shipped_presets() -> None:
    assert known_agents() == ("agent/aider", "agent/claude-code", "agent/codex",
                              "agent/gemini-cli", "agent/opencode")
    for agent in known_agents():
        for extends in (f"[{agent}]", f"[{{{agent}: {{telemetry: allow}}}}]"):
            policy = _policy(extends)
            assert policy.rules and all(r.policy.startswith(agent) for r in policy.rules)
            assert all(r.source.startswith(f"{agent}.yaml:") for r in policy.rules)


# What codex-cli 0.169 (`codex exec`), Claude Code 2.1 (`claude -p`) and gemini-cli 0.61
# (`gemini -p`) sent through the gateway, and how each call is decided with the
# telemetry switch off: (result, credential injected, the deciding rule has models).
SEEN = [
    ("agent/codex", "api.openai.com", "GET", "/v1/responses", ("allow", "openai", True)),
    ("agent/codex", "api.openai.com", "POST", "/v1/responses", ("allow", "openai", True)),
    ("agent/codex", "api.openai.com", "GET", "/v1/models", ("allow", "openai", False)),
    ("agent/codex", "chatgpt.com", "GET", "/backend-api/codex/models", ("deny", None, False)),
    ("agent/codex", "chatgpt.com", "GET", "/backend-api/plugins/export/curated",
     ("allow", None, False)),
    ("agent/codex", "github.com", "GET", "/openai/plugins.git/info/refs",
     ("allow", None, False)),
    ("agent/codex", "api.github.com", "GET", "/repos/openai/plugins", ("allow", None, False)),
    ("agent/codex", "ab.chatgpt.com", "POST", "/otlp/v1/metrics", ("deny", None, False)),
    ("agent/codex", "github.com", "GET", "/someone/else.git/info/refs", ("deny", None, False)),
    ("agent/claude-code", "api.anthropic.com", "POST", "/v1/messages",
     ("allow", "anthropic", True)),
    ("agent/claude-code", "api.anthropic.com", "GET", "/api/claude_code/settings",
     ("allow", "anthropic", False)),
    ("agent/claude-code", "api.anthropic.com", "GET", "/api/claude_cli/bootstrap",
     ("allow", "anthropic", False)),
    ("agent/claude-code", "api.anthropic.com", "GET", "/api/directory/server-urls",
     ("allow", None, False)),
    ("agent/claude-code", "api.anthropic.com", "POST", "/api/event_logging/v2/batch",
     ("deny", None, False)),
    ("agent/claude-code", "api.anthropic.com", "POST", "/api/eval/sdk-abc",
     ("deny", None, False)),
    ("agent/gemini-cli", "generativelanguage.googleapis.com", "POST",
     "/v1beta/models/gemini-3.5-flash-lite:generateContent", ("allow", "gemini", True)),
    ("agent/gemini-cli", "play.googleapis.com", "POST", "/log", ("deny", None, False)),
    ("agent/opencode", "models.opencode.ai", "GET", "/api.json", ("allow", None, False)),
    ("agent/aider", "raw.githubusercontent.com", "GET",
     "/BerriAI/litellm/main/model_prices_and_context_window.json", ("allow", None, False)),
    ("agent/aider", "raw.githubusercontent.com", "GET", "/someone/else/main/x.json",
     ("deny", None, False)),
    ("agent/aider", "pypi.org", "GET", "/pypi/aider-chat/json", ("deny", None, False)),
    ("agent/opencode", "registry.npmjs.org", "GET", "/@opencode-ai%2fplugin",
     ("deny", None, False)),
]


@pytest.mark.parametrize(("agent", "host", "method", "path", "expected"), SEEN,
                         ids=[f"{a}:{m} {h}{p}" for a, h, m, p, _ in SEEN])
def test_what_the_agents_send(agent: str, host: str, method: str, path: str,
                              expected: tuple[str, str | None, bool]) -> None:
    decision = _decide(_policy(f"[{agent}]"), host, method, path)
    result, credential, models = expected
    assert (decision.result, decision.credential) == (result, credential), decision.reason
    if decision.rule is not None or result == "allow":  # (no rule: a host the preset leaves)
        assert decision.rule is not None
        assert (decision.rule.models is not None) == models, decision.rule


def test_the_telemetry_switch() -> None:
    off = _decide(_policy("[agent/claude-code]"), "api.anthropic.com", "POST",
                  "/api/event_logging/v2/batch")
    assert off.result == "deny"
    assert off.reason == ("refused by rule agent/claude-code.yaml:31: agent/claude-code turns "
                          "the agent's telemetry off; extend {agent/claude-code: {telemetry: "
                          "allow}} to send it")
    on = _decide(_policy("[{agent/claude-code: {telemetry: allow}}]"), "api.anthropic.com",
                 "POST", "/api/event_logging/v2/batch")
    assert (on.result, on.credential) == ("allow", "anthropic")
    # A host-wide telemetry rule refuses the tunnel (nothing is intercepted for it).
    tunnel = _decide(_policy("[agent/codex]"), "ab.chatgpt.com")
    assert tunnel.result == "deny" and "telemetry off" in tunnel.reason
    assert _decide(_policy("[{agent/codex: {telemetry: allow}}]"),
                   "ab.chatgpt.com").result == "allow"


def test_a_narrower_models_rule_of_the_extending_policy_is_tried_first() -> None:
    policy = _policy("[agent/codex]", "egress:\n  - host: api.openai.com\n"
                     "    credential: openai\n    models: [gpt-4.1*]\n")
    model_call = _decide(policy, "api.openai.com", "POST", "/v1/responses")
    assert model_call.rule is not None and model_call.rule.models == ("gpt-4.1*",)
    # ...while the preset's settings and telemetry rules keep their calls.
    listing = _decide(policy, "api.openai.com", "GET", "/v1/models")
    assert listing.rule is not None and listing.rule.source == "agent/codex.yaml:16"


ERRORS = [
    ("[agent/nope]", CREDENTIALS, 'extends unknown policy "agent/nope"; the shipped agent '
     "presets are agent/aider, agent/claude-code, agent/codex, agent/gemini-cli, "
     "agent/opencode"),
    ("[{agent/codex: {telemetry: maybe}}]", CREDENTIALS,
     "invalid telemetry 'maybe'; use deny or allow"),
    ("[{base: {telemetry: allow}}]", CREDENTIALS, "only an agent preset takes options"),
    ("[agent/codex]", "credentials:\n  anthropic: {preset: anthropic, secret: k}\n",
     'agent/codex.yaml:14: unknown credential "openai"; agent/codex injects the credential '
     'named "openai": define it, e.g. credentials: {openai: {preset: openai, secret: '
     "<secret name>}}"),
]


@pytest.mark.parametrize(("extends", "credentials", "message"), ERRORS)
def test_errors(extends: str, credentials: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy_text("policies/p.yaml", f"version: v1\nname: p\nextends: {extends}\n"
                         f"{credentials}")
    assert message in str(info.value)


def test_policy_check_shows_what_a_preset_brings(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(f"version: v1\nname: p\nextends: [agent/codex]\n"
                                     f"{CREDENTIALS}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["policy", "check", str(tmp_path)]) == 0
    text = out.getvalue()
    assert "agent/codex (extended by p):" in text
    assert ("  allow host: api.openai.com; credential: openai; models: *  "
            "(agent/codex.yaml:13)") in text
    assert "  deny  host: ab.chatgpt.com  (agent/codex.yaml:38): agent/codex turns" in text
