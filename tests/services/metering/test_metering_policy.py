"""Policy fields for metering: `models:` on credential rules and `budgets:` (loader
validation with file:line errors, inheritance), and the model allowlist decision."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.core.metering.models import ModelNames, check_model, model_in_body
from gateway.core.policy.model import Rule
from gateway.services.policy import (
    PolicyError,
    load_policy_dir,
    load_policy_text,
    load_policy_texts,
)

HEAD = """\
version: v1
name: agent
credentials:
  openai: {preset: openai, secret: k1}
  anthropic: {preset: anthropic, secret: k2}
  gemini: {preset: gemini, secret: k3}
  aoai: {preset: azure-openai, secret: k4}
egress:
  - host: api.openai.com
    credential: openai
    models: ["gpt-4o-mini", "gpt-4.1-*"]
  - host: api.anthropic.com
    credential: anthropic
  - host: generativelanguage.googleapis.com
    credential: gemini
    models: ["gemini-2.0-flash*"]
  - host: my.openai.azure.com
    credential: aoai
    models: ["prod-4o"]
"""


def load(text: str, name: str = "p.yaml") -> object:
    return load_policy_text(name, textwrap.dedent(text))


def errors(text: str) -> list[str]:
    with pytest.raises(PolicyError) as info:
        load(text)
    return info.value.errors


def rules() -> dict[str, Rule]:
    policy = load_policy_text("p.yaml", HEAD).policies["agent"]
    return {r.credential or r.host: r for r in policy.rules}


# --- models: ----------------------------------------------------------------------------


def test_models_loaded_and_described() -> None:
    rule = rules()["openai"]
    assert rule.models == ("gpt-4o-mini", "gpt-4.1-*")
    assert rule.source == "p.yaml:9"
    assert "models: gpt-4o-mini, gpt-4.1-*" in rule.describe()
    assert rules()["anthropic"].models is None


@pytest.mark.parametrize(("snippet", "expected"), [
    ("  - host: pypi.org\n    models: [gpt-4o]\n",
     "p.yaml:5: models needs credential: on the same rule"),
    ("  - host: api.openai.com\n    credential: openai\n    models: []\n",
     "p.yaml:6: models is empty"),
    ("  - host: api.openai.com\n    credential: openai\n    models: gpt-4o\n",
     "p.yaml:6: models must be a list"),
    ("  - host: api.openai.com\n    credential: openai\n    models: [\"gpt 4o\"]\n",
     "p.yaml:6: invalid model pattern 'gpt 4o'"),
    ("  - host: api.openai.com\n    credential: openai\n    models: [3]\n",
     "p.yaml:6: each entry of models must be a non-empty string"),
    ("  - host: git.example.com\n    ports: [22]\n    protocol: tcp\n    models: [x]\n",
     "p.yaml:6: protocol: tcp cannot be combined with models"),
])
def test_models_errors(snippet: str, expected: str) -> None:
    text = ("version: v1\nname: p\negress:\n" + snippet
            + "credentials:\n  openai: {preset: openai, secret: k}\n")
    found = errors(text)
    assert any(e.startswith(expected) for e in found), found


CHECKS = [
    # credential, method, path, body -> refused?, reason fragment
    ("openai", "POST", "/v1/chat/completions", b'{"model":"gpt-4o-mini","messages":[]}',
     None),
    ("openai", "POST", "/v1/responses", b'{"model":"gpt-4.1-mini"}', None),
    ("openai", "POST", "/v1/chat/completions", b'{"model":"gpt-4o"}',
     'model "gpt-4o" is not allowed by rule p.yaml:9 (models: gpt-4o-mini, gpt-4.1-*)'),
    ("openai", "POST", "/v1/chat/completions", b'{"model":"GPT-4O-MINI"}',
     'model "GPT-4O-MINI" is not allowed'),  # case-sensitive
    ("openai", "POST", "/v1/chat/completions", b'{"messages":[]}', 'names no "model"'),
    ("openai", "POST", "/v1/chat/completions", b'{"model":["gpt-4o-mini"]}',
     'names no "model"'),
    ("openai", "POST", "/v1/chat/completions", b"model=gpt-4o-mini", "not a JSON object"),
    ("openai", "POST", "/v1/chat/completions", b'["gpt-4o-mini"]', "not a JSON object"),
    ("openai", "POST", "/v1/chat/completions", b"", "not a JSON object"),
    ("openai", "POST", "/v1/chat/completions", b'{"model":"gpt-4o-mini","model":"gpt-4o"}',
     "repeats a key"),
    ("openai", "POST", "/v1/chat/completions",
     b'{"model":"gpt-4o-mini","mod\\u0065l":"gpt-4o"}', "repeats a key"),  # escaped
    ("openai", "POST", "/v1/chat/completions",
     b'{"model":"gpt-4o-mini","messages":[{"role":"user","role":"x"}]}', None),
    ("openai", "POST", "/v1/chat/completions", b' {"model":"gpt-4o-mini"}\n', None),
    ("openai", "POST", "/v1/chat/completions", b'{}', 'names no "model"'),
    # an agent's telemetry call on a provider host: the advice fits it (issue 23)
    ("openai", "POST", "/api/event_logging/batch", b'{"events":[]}',
     "allow its path (/api/event_logging/batch) in a rule without models"),
    ("openai", "POST", "/v1/chat/completions", b'\xef\xbb\xbf{"model":"gpt-4o-mini"}',
     "not a JSON object"),
    ("openai", "POST", "/v1/chat/completions", None, "body was not available"),
    ("openai", "POST", "/v1/audio/transcriptions", b"--x\r\nContent-Disposition: form-data",
     "not a JSON object"),
    ("openai", "GET", "/v1/models", None, None),
    ("openai", "GET", "/v1/responses/resp_1", b"", None),
    ("gemini", "POST", "/v1beta/models/gemini-2.0-flash-001:generateContent", None, None),
    ("gemini", "POST", "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse",
     b'{"model":"gemini-2.0-flash"}', 'model "gemini-2.5-pro" is not allowed by rule p.yaml:14'),
    ("gemini", "POST", "/v1beta/models/gemini-2.0-flash%2F..%2F..%2Fmodels%2Fgemini-ultra:"
     "generateContent", None, "is not a plain model name"),
    ("gemini", "GET", "/v1beta/models/gemini-ultra", None, None),  # metadata, no model call
    ("gemini", "POST", "/v1beta/models/gemini-ultra%3AgenerateContent",
     b'{"model":"gemini-2.0-flash"}', "is not a plain model name"),  # Google decodes %3A
    ("aoai", "POST", "/openai/deployments/prod-4o/chat/completions?api-version=2024-10-21",
     b'{"model":"whatever"}', None),
    ("aoai", "POST", "/openai/deployments/dev-4o/chat/completions?api-version=2024-10-21",
     b'{"model":"prod-4o"}', 'model "dev-4o" is not allowed'),
    ("anthropic", "POST", "/v1/messages", b"not json", None),  # no models: on this rule
    # Realtime: a WebSocket GET names its model in the query
    ("openai", "GET", "/v1/realtime?model=gpt-4o-realtime-preview", None,
     'model "gpt-4o-realtime-preview" is not allowed'),
    ("openai", "GET", "/v1/realtime?model=gpt-4.1-realtime", None, None),
    ("openai", "GET", "/v1/realtime?model=gpt-4o-mini&MODEL=gpt-4o", None,
     'model "gpt-4o" is not allowed'),  # every copy is checked
    ("openai", "GET", "/v1/realtime?model=gpt-4o-mini%2F..%2Fgpt-4o", None,
     "not a plain model name"),
    ("openai", "GET", "/v1/realtime?mod%65l=gpt-4o", None, 'model "gpt-4o" is not allowed'),
    ("openai", "POST", "/v1/chat/completions?model=gpt-4o", b'{"model":"gpt-4o-mini"}',
     'model "gpt-4o" is not allowed'),
    ("aoai", "GET", "/openai/realtime?api-version=2024-10-01-preview&deployment=dev-4o",
     None, 'model "dev-4o" is not allowed'),
    ("aoai", "GET", "/openai/realtime?api-version=2024-10-01-preview&deployment=prod-4o",
     None, None),
]


@pytest.mark.parametrize(("credential", "method", "path", "body", "reason"), CHECKS)
def test_check_model(credential: str, method: str, path: str, body: bytes | None,
                     reason: str | None) -> None:
    refusal = check_model(rules()[credential], method, path, body)
    if reason is None:
        assert refusal is None
    else:
        assert refusal is not None
        assert reason in refusal.reason, refusal.reason
        assert (refusal.status, refusal.code) == (403, "model_not_allowed")
        assert refusal.rule == rules()[credential].source
        # the "rule without models" advice is for paths that are no inference endpoint
        assert ("rule without models" in refusal.reason) == ("/api/" in path)


def test_model_in_body() -> None:
    r = rules()
    assert model_in_body(r["openai"], "POST", "/v1/chat/completions")
    assert not model_in_body(r["openai"], "GET", "/v1/models")
    assert not model_in_body(r["gemini"], "POST",
                             "/v1beta/models/gemini-2.0-flash:generateContent")
    assert not model_in_body(r["anthropic"], "POST", "/v1/messages")  # no models:


def test_model_names_are_bounded() -> None:
    names = ModelNames(limit=3)
    assert names(None) == "unknown"
    assert [names(m) for m in ("a-1", "b-2", "a-1", "c/3")] == ["a-1", "b-2", "a-1", "c/3"]
    assert names("d-4") == "other"  # over the limit
    assert names("a-1") == "a-1"    # known ones stay
    assert ModelNames()("bad model\n") == "other"
    assert ModelNames()("x" * 101) == "other"


# --- budgets: ---------------------------------------------------------------------------

BUDGETS = """\
version: v1
name: agent
extends: [base]
egress:
  - host: api.openai.com
    credential: openai
  - host: api.anthropic.com
    credential: anthropic
budgets:
  - name: sandbox-daily
    per: sandbox
    window: 24h
    tokens: 2000000
    requests: 5000
    cost_usd: 50
    credentials: [openai]
  - name: monthly
    per: policy
    window: month
    cost_usd: 1000.5
credentials:
  openai: {preset: openai, secret: k1}
  anthropic: {preset: anthropic, secret: k2}
---
version: v1
name: base
egress:
  - host: pypi.org
budgets:
  - {name: monthly, per: policy, window: 30d, requests: 1}
  - {name: hourly, per: sandbox, window: 1h, requests: 100}
"""


def test_budgets_loaded_with_inheritance() -> None:
    policies = load_policy_text("b.yaml", BUDGETS).policies
    agent = {b.name: b for b in policies["agent"].budgets}
    assert list(agent) == ["sandbox-daily", "monthly", "hourly"]
    daily = agent["sandbox-daily"]
    assert (daily.per, daily.window, daily.tokens, daily.requests, daily.cost_usd) == (
        "sandbox", 86400, 2_000_000, 5000, 50.0)
    assert daily.credentials == ("openai",)
    assert daily.source == "b.yaml:10" and daily.policy == "agent"
    assert daily.applies_to("openai") and not daily.applies_to("anthropic")
    # The own "monthly" replaces base's; base's "hourly" is inherited.
    assert agent["monthly"].window == "month" and agent["monthly"].cost_usd == 1000.5
    assert agent["monthly"].source == "b.yaml:17"
    assert agent["hourly"].policy == "base" and agent["hourly"].applies_to("anthropic")
    assert [b.name for b in policies["base"].budgets] == ["monthly", "hourly"]
    assert daily.describe() == ("sandbox-daily: per sandbox, window 24h; tokens 2,000,000, "
                                "requests 5,000, cost_usd 50; credentials: openai")


BUDGET_ERRORS = [
    ("- {per: sandbox, window: 1h, tokens: 1}", "p.yaml:6: budget has no name"),
    ("- {name: a, window: 1h, tokens: 1}", "p.yaml:6: budget has no per"),
    ("- {name: a, per: replica, window: 1h, tokens: 1}", "p.yaml:6: invalid per 'replica'"),
    ("- {name: a, per: sandbox, tokens: 1}", "p.yaml:6: budget has no window"),
    ("- {name: a, per: sandbox, window: soon, tokens: 1}", "p.yaml:6: window: 'soon' is not a "
     "duration"),
    ("- {name: a, per: sandbox, window: 30s, tokens: 1}", "p.yaml:6: window '30s' must be "
     "whole seconds, at least 1m"),
    ("- {name: a, per: sandbox, window: 1h}", "p.yaml:6: budget sets no limit"),
    ("- {name: a, per: sandbox, window: 1h, tokens: -5}", "p.yaml:6: tokens must be a "
     "positive whole number"),
    ("- {name: a, per: sandbox, window: 1h, requests: 1.5}", "p.yaml:6: requests must be a "
     "positive whole number"),
    ("- {name: a, per: sandbox, window: 1h, tokens: true}", "p.yaml:6: tokens must be"),
    ("- {name: a, per: sandbox, window: 1h, cost_usd: .nan}", "p.yaml:6: cost_usd must be a "
     "positive number"),
    ("- {name: a, per: sandbox, window: 1h, tokens: 1, limit: 3}", 'p.yaml:6: unknown key '
     '"limit" in a budget'),
    ("- {name: a, per: sandbox, window: 1h, tokens: 1, credentials: [opneai]}",
     'p.yaml:6: budget "a" names unknown credential "opneai" (did you mean "openai"?)'),
    ("- {name: a, per: sandbox, window: 1h, tokens: 1, credentials: [other]}",
     'p.yaml:6: budget "a" limits credential "other", which no rule of policy "p" injects'),
    ("- {name: a, per: sandbox, window: 1h, tokens: 1, credentials: []}",
     "p.yaml:6: credentials is empty"),
    ("- {name: a, per: sandbox, window: 1h, tokens: 1}\n  - {name: a, per: policy, window: 1h,"
     " tokens: 2}", 'p.yaml:7: duplicate budget "a" (first at line 6)'),
    ("- {name: 'a b', per: sandbox, window: 1h, tokens: 1}", 'p.yaml:6: invalid budget name'),
]


@pytest.mark.parametrize(("budget", "expected"), BUDGET_ERRORS)
def test_budget_errors(budget: str, expected: str) -> None:
    text = ("version: v1\nname: p\negress:\n  - {host: api.openai.com, credential: openai}\n"
            "budgets:\n  " + budget + "\ncredentials:\n  openai: {preset: openai, secret: k}\n"
            "  other: {preset: anthropic, secret: k2}\n")
    found = errors(text)
    assert any(e.startswith(expected) for e in found), found


def test_budgets_not_a_list() -> None:
    assert errors("version: v1\nname: p\nbudgets: {a: 1}\n") == [
        "p.yaml:3: budgets must be a list (- name: ..., per: ..., window: ...)"]


def test_policy_without_budgets_loads() -> None:
    policy_set = load_policy_texts({"a.yaml": "version: v1\nname: a\nbudgets:\n"})
    assert policy_set.policies["a"].budgets == ()


# --- the example policy and the CLI -----------------------------------------------------

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "policies"


def test_example_policy_checks_and_explains(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "check", str(EXAMPLES)]) == 0
    assert "1 policies, 3 rules, 2 credentials: OK" in capsys.readouterr().out
    policy = load_policy_dir(EXAMPLES).policies["inference-budget"]
    assert [b.name for b in policy.budgets] == ["sandbox-daily", "team-monthly"]
    assert main(["policy", "explain", "--dir", str(EXAMPLES), "--policy", "inference-budget",
                 "POST", "https://api.anthropic.com/v1/messages"]) == 0
    out = capsys.readouterr().out
    assert "models: claude-sonnet-4-5*, claude-haiku-4-5*" in out
    assert "budget:   sandbox-daily: per sandbox, window 24h; tokens 2,000,000" in out
    assert "budget:   team-monthly: per policy, window month; cost_usd 500" in out
    rule = next(r for r in policy.rules if r.models and r.credential == "openai")
    assert check_model(rule, "POST", "/v1/chat/completions", b'{"model":"gpt-4o"}') is not None
    assert check_model(rule, "POST", "/v1/chat/completions",
                       b'{"model":"gpt-4o-mini-2024-07-18"}') is None
