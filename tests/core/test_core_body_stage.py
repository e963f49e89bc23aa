"""The body stage (core/body_stage.py), table-driven: what an mcp: rule's step and the
metering step decide on a method and body, and how mode: report records instead."""

from __future__ import annotations

import json

import pytest

from gateway.core.body_stage import askable_model, dlp_stage, mcp_stage, metering_stage
from gateway.core.evaluate import UNSEEN
from gateway.core.policy import Policy, Rule
from gateway.core.policy.mcp_rule import McpRule
from gateway.services.metering import static_metering
from gateway.services.policy import load_policy_texts

POLICY = """
version: v1
name: agent
egress:
  - host: mcp.test
    mcp:
      tools: {allow: ["search_*"], deny: ["delete_*"]}
  - host: api.openai.com
    credential: openai
    models: ["gpt-4o-mini*"]
credentials:
  openai: {preset: openai, secret: k}
"""


def _call(name: str) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                       "params": {"name": name}}).encode()


def _policy(text: str = POLICY) -> Policy:
    return load_policy_texts({"policies/agent.yaml": text}).policies["agent"]


def _rule(policy: Policy, host: str) -> Rule:
    return next(e.rule for e in policy.matcher.candidates(host))


@pytest.fixture(scope="module")
def rules() -> tuple[McpRule, Policy]:
    policy = _policy()
    rule = _rule(policy, "mcp.test").mcp
    assert rule is not None
    return rule, policy


MCP = [  # (method, body, code or None, calls read)
    ("POST", _call("search_issues"), None, 1),
    ("POST", _call("delete_repo"), "mcp_denied", 1),
    ("POST", _call("other"), "mcp_denied", 1),
    ("POST", None, "mcp_denied", 0),  # not held whole
    ("POST", b"not json", "mcp_denied", 0),
    ("POST", UNSEEN, None, 0),  # no body known: the method alone
    ("PUT", UNSEEN, "mcp_denied", 0),  # no MCP transport uses PUT
    ("GET", b"", None, 0),
    ("GET", b'{"x": 1}', "mcp_denied", 0),  # a body on a GET is never read
    ("DELETE", UNSEEN, None, 0),
]


@pytest.mark.parametrize(("method", "body", "code", "read"), MCP)
def test_mcp_stage(rules: tuple[McpRule, Policy], method: str, body: object,
                   code: str | None, read: int) -> None:
    rule, _ = rules
    for mode in ("enforce", "report"):
        stage = mcp_stage(rule, mode, method, body, frozenset(), "p.yaml:5")
        assert (stage.refusal.code if stage.refusal else None) == code
        assert len(stage.calls) == read
        assert stage.report == (code is not None and mode == "report")
        assert stage.enforced is (stage.refusal if mode == "enforce" else None)


@pytest.mark.parametrize("pinned", [True, False])
def test_a_quarantined_tool_is_refused_where_descriptions_are_pinned(pinned: bool) -> None:
    text = POLICY.replace('deny: ["delete_*"]}', 'deny: ["delete_*"]}\n      '
                          f"pin_descriptions: {str(pinned).lower()}")
    rule = _rule(_policy(text), "mcp.test").mcp
    assert rule is not None and rule.pin_descriptions is pinned
    stage = mcp_stage(rule, "enforce", "POST", _call("search_issues"), {"search_issues"},
                      "p.yaml:5")
    assert (stage.refusal is not None) is pinned


METERED = [  # (body, code or None, the model a person may be asked about)
    (b'{"model": "gpt-4o-mini", "messages": []}', None, None),
    (b'{"model": "gpt-4o", "messages": []}', "model_not_allowed", "gpt-4o"),
    (b'{"model": "gpt-4*", "messages": []}', "model_not_allowed", None),  # a glob: never
    (b'{"model": "gpt-4o-mini", "models": ["gpt-4o"]}', "model_not_allowed", "gpt-4o"),
    (b'{"model": "gpt-4o-mini", "Model": "gpt-4o"}', "model_not_allowed", None),
]


@pytest.mark.parametrize(("body", "code", "ask"), METERED)
def test_metering_stage(body: bytes, code: str | None, ask: str | None) -> None:
    policy = _policy()
    rule = _rule(policy, "api.openai.com")
    stage = metering_stage(static_metering(), policy, rule, sandbox="s", preset="openai",
                           method="POST", path="/v1/chat/completions", body=body, now=0.0)
    assert (stage.refusal.code if stage.refusal else None) == code
    assert stage.ask == ask and stage.report is False
    assert (stage.admitted is not None) == (code is None)
    if ask is not None:  # a person's grant lets it through
        granted = metering_stage(static_metering(), policy, rule, sandbox="s",
                                 preset="openai", method="POST",
                                 path="/v1/chat/completions", body=body, now=0.0,
                                 granted=ask)
        assert granted.refusal is None


@pytest.mark.parametrize(("model", "askable"), [
    ("gpt-4o", True), (None, False), ("", False), ("gpt-*", False), ("m[1]", False)])
def test_askable_model(model: str | None, askable: bool) -> None:
    assert askable_model(model) is askable


DLP_POLICY = """
version: v1
name: agent
dlp: {action: refuse}
egress:
  - host: paste.test
  - host: pypi.test
    dlp: {allow: [{detector: github, hosts: [pypi.test]}]}
  - host: report.test
    dlp: {action: report}
  - host: off.test
    dlp: false
"""


@pytest.mark.parametrize(("host", "target", "body", "mode", "code", "report"), [
    ("paste.test", "/p", b'{"t": "%s"}', "enforce", "secret_detected", False),
    ("paste.test", "/p?t=%s", b"", "enforce", "secret_detected", False),  # the URL
    ("paste.test", "/p", UNSEEN, "enforce", None, False),   # no body known: the line only
    ("paste.test", "/p", b'{"t": "%s"}', "report", "secret_detected", True),
    ("pypi.test", "/p", b'{"t": "%s"}', "enforce", None, False),   # allowed there
    ("report.test", "/p", b'{"t": "%s"}', "enforce", None, False),  # forwarded, recorded
    ("off.test", "/p", b'{"t": "%s"}', "enforce", None, False),
    ("paste.test", "/p", b'{"t": "clean"}', "enforce", None, False),
])
def test_dlp_stage(host: str, target: str, body: object, mode: str, code: str | None,
                   report: bool) -> None:
    from helpers.dlp_corpus import fake

    from gateway.services.dlp.detectors import for_tools

    token = fake("github").text
    text = DLP_POLICY if mode == "enforce" else DLP_POLICY.replace("name: agent",
                                                                   "name: agent\nmode: report")
    policy = _policy(text)
    rule = next(r for r in policy.rules if r.host == host)
    if isinstance(body, bytes) and b"%s" in body:
        body = body.replace(b"%s", token.encode())
    stage = dlp_stage(for_tools(), policy, rule, host=host, method="POST",
                      target=target.replace("%s", token), body=body)
    assert (stage.refusal.code if stage.refusal else None, stage.report) == (code, report)
    if stage.refusal is not None:
        assert token not in stage.refusal.reason and "github" in stage.refusal.reason
