"""`mcp:` on a rule as a policy file writes it: what loads, what is refused and how."""

from __future__ import annotations

import pytest

from gateway.services.policy import PolicyError, Request, decide, load_policy_text
from gateway.services.policy.mcp_rule import Names


def _load(rule: str) -> object:
    return load_policy_text("p.yaml", f"version: v1\nname: p\negress:\n{rule}")


def test_a_full_mcp_rule() -> None:
    policy = load_policy_text("p.yaml", """version: v1
name: p
egress:
  - host: mcp.example.com
    credential: example
    mcp:
      tools: {allow: ["search_*", get_issue, get_issue], deny: ["delete_*"]}
      resources: {allow: ["repo://org/*"]}
      prompts: {allow: []}
      arguments: {get_issue: {repo: "org/*"}}
      pin_descriptions: true
credentials:
  example: {hosts: [mcp.example.com], secret: example-key, inject: {bearer: true}}
""").get("p")
    assert policy is not None
    mcp = policy.rules[0].mcp
    assert mcp is not None
    assert mcp.tools == Names(allow=("search_*", "get_issue"), deny=("delete_*",))
    assert mcp.prompts == Names() and dict(mcp.arguments) == {"get_issue": {"repo": "org/*"}}
    assert mcp.pin_descriptions
    # An mcp rule is always inspected: its calls are read.
    decision = decide(policy, Request(None, "https", "mcp.example.com", 443, None))
    assert decision.result == "allow" and decision.inspect
    assert "mcp: tools allow search_*, get_issue deny delete_*" in policy.rules[0].describe()


ERRORS = [
    ("unknown key", "    mcp: {tool: {allow: [a]}}",
     'unknown key "tool" in mcp (did you mean "tools"?)'),
    ("not a mapping", "    mcp: [a]", "mcp must be a mapping"),
    ("allow not a list", "    mcp: {tools: {allow: a}}", "mcp.tools.allow must be a list"),
    ("unknown list", "    mcp: {tools: {only: [a]}}", 'unknown key "only" in mcp.tools'),
    ("arguments not a mapping", "    mcp: {arguments: [a]}", "mcp.arguments must map"),
    ("argument glob not a string", "    mcp: {arguments: {t: {a: 1}}}",
     "mcp.arguments.t.a must be a non-empty string"),
    ("pin not a boolean", "    mcp: {pin_descriptions: yes please}",
     "mcp.pin_descriptions must be true or false"),
    ("on a tcp rule", "    protocol: tcp\n    ports: [22]\n    mcp: {tools: {allow: [a]}}",
     "protocol: tcp cannot be combined with mcp"),
    ("on a deny rule", "    action: deny\n    mcp: {tools: {allow: [a]}}", "mcp"),
]


@pytest.mark.parametrize(("case", "extra", "message"), ERRORS, ids=[e[0] for e in ERRORS])
def test_mistakes_are_named(case: str, extra: str, message: str) -> None:
    with pytest.raises(PolicyError) as exc:
        _load(f"  - host: mcp.example.com\n{extra}\n")
    assert message in str(exc.value), str(exc.value)
