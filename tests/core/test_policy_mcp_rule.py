"""`mcp:` on a rule as a policy file writes it: what loads, what is refused and how."""

from __future__ import annotations

import pytest

from gateway.core.policy import Request, decide
from gateway.core.policy.mcp_rule import McpRule, Names
from gateway.services.policy import PolicyError, load_policy_text


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
      server_requests: allow
credentials:
  example: {hosts: [mcp.example.com], secret: example-key, inject: {bearer: true}}
""").get("p")
    assert policy is not None
    mcp = policy.rules[0].mcp
    assert mcp is not None
    assert mcp.tools == Names(allow=("search_*", "get_issue"), deny=("delete_*",))
    assert mcp.prompts == Names() and dict(mcp.arguments) == {"get_issue": {"repo": "org/*"}}
    assert mcp.pin_descriptions and mcp.server_requests == "allow"
    assert McpRule().server_requests == "deny"  # (the default: servers do not ask)
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
    ("server_requests neither allow nor deny", "    mcp: {server_requests: true}",
     "mcp.server_requests must be allow or deny"),
    ("on a tcp rule", "    protocol: tcp\n    ports: [22]\n    mcp: {tools: {allow: [a]}}",
     "protocol: tcp cannot be combined with mcp"),
    ("on a deny rule", "    action: deny\n    mcp: {tools: {allow: [a]}}", "mcp"),
    ("** inside a resource segment", "    mcp: {resources: {allow: ['repo://org/x**']}}",
     "'**' must be a whole segment"),
    ("** inside an argument segment", "    mcp: {arguments: {t: {repo: 'org**'}}}",
     "'**' must be a whole segment"),
]


@pytest.mark.parametrize(("case", "extra", "message"), ERRORS, ids=[e[0] for e in ERRORS])
def test_mistakes_are_named(case: str, extra: str, message: str) -> None:
    with pytest.raises(PolicyError) as exc:
        _load(f"  - host: mcp.example.com\n{extra}\n")
    assert message in str(exc.value), str(exc.value)


# The docs' own rule (docs/policies.md, MCP section).
DOCS_RULE = McpRule(tools=Names(allow=("search_*", "get_issue"), deny=("delete_*",)),
                    resources=Names(allow=("repo://org/*", "repo://org/docs/**"),
                                    deny=("repo://org/secret*",)),
                    arguments={"get_issue": {"repo": "org/*"},
                               "read_file": {"path": "docs/**"}})

# (tool, argument, value, None if allowed else a phrase of the refusal)
ARGUMENTS = [
    ("get_issue", "repo", "org/api", None),
    ("get_issue", "repo", "org/./api", None),
    ("get_issue", "repo", "org//api", None),
    ("get_issue", "repo", "org/../evil/secret", "(read as 'evil/secret') does not match"),
    ("get_issue", "repo", "org/api/../../evil", "(read as 'evil') does not match"),
    ("get_issue", "repo", "org/a/b", "does not match 'org/*'"),
    ("get_issue", "repo", "org/%2e%2e/evil", "(read as 'evil') does not match"),
    ("get_issue", "repo", "../org/api", "argument 'repo' = '../org/api' is refused: it goes "
     "above its root"),
    ("get_issue", "repo", "org%2f..%2fevil", "argument 'repo' = 'org%2f..%2fevil' is "
     "refused: it has an escape that decodes to '/'"),
    ("get_issue", "repo", "org/%2561", "argument 'repo' = 'org/%2561' is refused"),
    ("get_issue", "repo", "org/%ff", "argument 'repo' = 'org/%ff' is refused"),
    ("get_issue", "repo", "org/a\x00", "is refused: it contains a NUL byte"),
    ("get_issue", "repo", 7, "needs argument 'repo' as a string"),
    ("read_file", "path", "docs", None),
    ("read_file", "path", "docs/a/b/c.md", None),
    ("read_file", "path", "docs/a/../../etc/passwd", "(read as 'etc/passwd') does not match"),
    ("search_code", "query", "anything/at/all", None),  # (an unconstrained tool)
]


@pytest.mark.parametrize(("tool", "key", "value", "refused"), ARGUMENTS)
def test_argument_globs_match_by_segment(tool: str, key: str, value: object,
                                         refused: str | None) -> None:
    found = DOCS_RULE.argument_refusal(tool, {key: value})
    if refused is None:
        assert found is None
    else:
        assert found is not None and refused in found, found
        assert f"argument {key!r}" in found


# (uri, None if allowed else a phrase of the refusal)
RESOURCES = [
    ("repo://org/readme", None),
    ("repo://org/a/../readme", None),
    ("repo://org/readme?ref=main/x", None),
    ("repo://org/docs/a/b", None),
    ("repo://org/../../vault/key", "is refused: it goes above its root"),
    ("repo://org/x/../../../vault/key", "is refused: it goes above its root"),
    ("repo://org/a/b", "not in the rule's mcp.resources.allow list"),
    ("repo://org/%2e%2e/vault", "is refused: it goes above its root"),
    ("repo://org/x%2f..%2f..%2fvault", "has an escape that decodes to '/'"),
    ("repo://org/secret", "denied by the rule's pattern 'repo://org/secret*'"),
    ("repo://org/secrets/key", "denied by the rule's pattern 'repo://org/secret*'"),
    ("repo://org/docs/../secret", "denied by the rule's pattern"),
    ("repo://org/secret?/../allowed", "denied by the rule's pattern"),
    ("repo://vault/key", "not in the rule's mcp.resources.allow list"),
]


@pytest.mark.parametrize(("uri", "refused"), RESOURCES)
def test_resource_globs_match_by_segment(uri: str, refused: str | None) -> None:
    found = DOCS_RULE.resource_refusal(uri)
    if refused is None:
        assert found is None
    else:
        assert found is not None and refused in found, found


@pytest.mark.parametrize(("name", "refused"), [
    ("search_code", None), ("search_a/b", None), ("delete_repo", "denied by"),
    ("get_issues", "not in the rule's mcp.tools.allow list")])
def test_tool_names_are_names(name: str, refused: str | None) -> None:
    found = DOCS_RULE.tools.refusal("tool", name)
    assert (found is None) if refused is None else (found is not None and refused in found)


def test_oauth_is_described() -> None:
    from gateway.core.policy.mcp_rule import McpOAuth

    rule = McpRule(oauth=McpOAuth(scopes=("repo", "read:org"), client="github"))
    assert rule.describe().endswith(
        "oauth (scopes repo read:org; client github; consent per sandbox)")
    assert "oauth (scopes the server's; client auto; consent per policy)" in \
        McpRule(oauth=McpOAuth(consent="policy")).describe()
