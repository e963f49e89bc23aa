"""The `mcp:` reader on its own: a rule's `mcp:` node in, an `McpRule` (or None) out,
every problem with its line."""

from __future__ import annotations

import pytest

from gateway.core.policy.mcp_rule import McpOAuth, McpRule, Names
from gateway.services.policy.read_mcp import read_mcp
from tests.helpers.policy_yaml import read

LOADS = [
    ("{}", McpRule()),
    ("{tools: {allow: [a, 'b_*', a], deny: ['x*']}}",
     McpRule(tools=Names(allow=("a", "b_*"), deny=("x*",)))),
    ("{prompts: {allow: []}}", McpRule(prompts=Names())),
    ("{resources: {allow: ['repo://org/*', 'repo://org/docs/**']}}",
     McpRule(resources=Names(allow=("repo://org/*", "repo://org/docs/**")))),
    ("{arguments: {get_issue: {repo: 'org/*'}, search: {}}}",
     McpRule(arguments={"get_issue": {"repo": "org/*"}, "search": {}})),
    ("{pin_descriptions: true, server_requests: allow}",
     McpRule(pin_descriptions=True, server_requests="allow")),
    ("{server_requests: deny}", McpRule()),
    ("{oauth: {}}", McpRule(oauth=McpOAuth())),
    ("{oauth: {scopes: [repo, 'read:org', repo], client: github-app, consent: policy}}",
     McpRule(oauth=McpOAuth(scopes=("repo", "read:org"), client="github-app",
                            consent="policy"))),
    ("{oauth: {client: auto, consent: sandbox}}", McpRule(oauth=McpOAuth())),
    ("{oauth: {consent: user}}", McpRule(oauth=McpOAuth(consent="user"))),
]


@pytest.mark.parametrize(("text", "want"), LOADS)
def test_what_loads(text: str, want: McpRule) -> None:
    assert read(read_mcp, text) == (want, [])


REFUSED = [
    ("[a]", ["1: mcp must be a mapping (key: value)"]),
    ("{tools: [a]}", ["1: mcp.tools must be a mapping (key: value)"]),
    ("tools:\n  allow: a\n", ['2: mcp.tools.allow must be a list, e.g. mcp.tools.allow: '
                              '["..."]']),
    ("arguments: [a]\n", ['1: mcp.arguments must map tool names to {argument: glob}, e.g. '
                          '{get_issue: {repo: "org/*"}}']),
    ("arguments:\n  t: [a]\n", ["2: mcp.arguments.t must map argument names to globs"]),
    ("arguments:\n  t:\n    a: 1\n", ["3: mcp.arguments.t.a must be a non-empty string"]),
    ("arguments:\n  1: {a: b}\n", ["2: mcp.arguments keys must be tool names"]),
    ("pin_descriptions: yes please\n", ["1: mcp.pin_descriptions must be true or false"]),
    ("server_requests: true\n", ["1: mcp.server_requests must be allow or deny"]),
    ("resources:\n  allow:\n    - 'repo://org/*'\n    - 'repo://org/x**'\n",
     ["4: glob 'repo://org/x**': '**' must be a whole segment (e.g. org/**); '*' matches "
      "within one segment"]),
    ("arguments:\n  t:\n    repo: 'org**'\n",
     ["3: glob 'org**': '**' must be a whole segment (e.g. org/**); '*' matches within one "
      "segment"]),
    ("oauth: [a]\n", ["1: mcp.oauth must be a mapping (key: value)"]),
    ("oauth:\n  scopes: repo\n", ['2: mcp.oauth.scopes must be a list, e.g. '
                                   'mcp.oauth.scopes: ["..."]']),
    ("oauth:\n  scopes:\n    - ok\n    - 'two words'\n",
     ["4: mcp.oauth.scopes: 'two words' is not an OAuth scope (printable ASCII, no space, "
      "quote or backslash: RFC 6749 3.3)"]),
    ("oauth:\n  client: 'my client'\n",
     ["2: mcp.oauth.client: 'my client' is not a client name (letters, digits, '_', '.', "
      "'-'; a name in the gateway config's mcp_oauth.clients) nor auto"]),
    ("oauth:\n  consent: everyone\n",
     ["2: mcp.oauth.consent must be sandbox (the grant serves this sandbox), policy (every "
      "sandbox of the policy) or user (every sandbox whose token names the same user)"]),
]


@pytest.mark.parametrize(("text", "problems"), REFUSED)
def test_what_is_refused_and_where(text: str, problems: list[str]) -> None:
    assert read(read_mcp, text) == (None, problems)


REPORTED = [
    ("{tool: {allow: [a]}}", McpRule(),
     ['1: unknown key "tool" in mcp (did you mean "tools"?); known keys: tools, resources, '
      "prompts, arguments, pin_descriptions, server_requests, oauth"]),
    ("tools:\n  allow: [a, '']\n", McpRule(tools=Names(allow=("a",))),
     ["2: each entry of mcp.tools.allow must be a non-empty string"]),
    ("oauth:\n  scope: [a]\n", McpRule(oauth=McpOAuth()),
     ['2: unknown key "scope" in mcp.oauth (did you mean "scopes"?); known keys: scopes, '
      'client, consent']),
]


@pytest.mark.parametrize(("text", "want", "problems"), REPORTED)
def test_a_problem_is_reported_and_the_rest_read(text: str, want: McpRule,
                                                 problems: list[str]) -> None:
    """An unknown key or a bad entry is reported (failing the load) and the rest read."""
    assert read(read_mcp, text) == (want, problems)
