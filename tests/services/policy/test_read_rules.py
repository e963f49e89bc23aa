"""The egress reader on its own: a rule's YAML in, the `Rule` the matcher is compiled from
out (with the line of its credential), every problem with its line; and from the file to
a decision: `read_egress` -> `compile_policy` -> `decide`, nothing in between."""

from __future__ import annotations

import pytest

from gateway.core.policy.ask_rule import Ask
from gateway.core.policy.compiled import compile_policy, decide
from gateway.core.policy.mcp_rule import McpOAuth, McpRule, Names
from gateway.core.policy.model import Credential, Injection, MeteringRule, Request, Rule
from gateway.services.policy.raw import RawRule
from gateway.services.policy.read_rules import read_egress, read_metering, read_rule
from tests.helpers.policy_yaml import FILE, read


def rule(**fields: object) -> Rule:
    """A rule as read from line 1 of the file, in policy "team"."""
    return Rule(source=f"{FILE}:1", policy="team", **fields)  # type: ignore[arg-type]


LOADS = [
    ("{host: A.Example.COM}", rule(host="a.example.com")),
    ("{host: '*.example.com', ports: [443, 8443, 443]}",
     rule(host="*.example.com", ports=(443, 8443))),
    ("{host: a.test, methods: [get, Post, PROPFIND, GET]}",
     rule(host="a.test", methods=("GET", "POST", "PROPFIND"))),
    ("{host: a.test, paths: ['/v1/**', /x, /x]}", rule(host="a.test", paths=("/v1/**", "/x"))),
    ("{host: a.test, inspect: true}", rule(host="a.test", inspect=True)),
    ("{host: a.test, protocol: http}", rule(host="a.test")),
    ("{host: a.test, protocol: tcp, ports: [22]}", rule(host="a.test", protocol="tcp",
                                                        ports=(22,))),
    ("{host: a.test, credential: k, models: ['gpt-4o*', o3, o3]}",
     rule(host="a.test", credential="k", models=("gpt-4o*", "o3"))),
    ("{host: a.test, credential: k, metering: optional, unmetered: [/v1/files],"
     " allow_minted_secrets: true}",
     rule(host="a.test", credential="k", metering=MeteringRule(required=False),
          unmetered=("/v1/files",), allow_minted_secrets=True)),
    ("{host: a.test, action: deny, reason: not here}",
     rule(host="a.test", action="deny", reason="not here")),
    ("{host: a.test, action: allow}", rule(host="a.test")),
    ("{host: a.test, ask: true}", rule(host="a.test", ask=Ask())),
    ("{host: a.test, ask: false}", rule(host="a.test")),
    ("{host: a.test, ask: {timeout: 5s}}", rule(host="a.test", ask=Ask(timeout=5, timed=True))),
    ("{host: a.test, mcp: {tools: {allow: [a]}}}",
     rule(host="a.test", mcp=McpRule(tools=Names(allow=("a",))))),
    ("{host: a.test, mcp: {oauth: {scopes: [repo], consent: policy}}}",
     rule(host="a.test", mcp=McpRule(oauth=McpOAuth(scopes=("repo",), consent="policy")))),
]


@pytest.mark.parametrize(("text", "want"), LOADS)
def test_a_rule_is_read_into_the_rule_the_matcher_takes(text: str, want: Rule) -> None:
    raw, problems = read(read_rule, text, "team")
    assert problems == []
    assert raw == RawRule(want, credential_line=1)
    assert raw.rule.host_pattern.text == want.host  # (compiled where it was read)


def test_the_credential_line_is_where_the_credential_is_named() -> None:
    raw, _ = read(read_rule, "host: a.test\nports: [443]\ncredential: k\n", "team")
    assert (raw.rule.source, raw.credential_line) == (f"{FILE}:1", 3)


REFUSED = [
    ("{ports: [443]}", ["1: egress rule has no host; add host: <name>"]),
    ("{host: 5}", ["1: host must be a non-empty string"]),
    ("host: 'https://a.test'\n", ["1: host pattern 'https://a.test' contains a URL scheme; "
                                  "drop it and write only the host, e.g. 'a.test' (ports go "
                                  "in ports:, paths in paths:)"]),
    ("host: a.test\nports: [0, 443, true]\n",
     ["2: invalid port 0; use a number from 1 to 65535",
      "2: invalid port True; use a number from 1 to 65535"]),
    ("host: a.test\nports: []\n", ["2: ports must be a non-empty list of numbers, e.g. ports: "
                                   "[443]"]),
    ("host: a.test\nmethods:\n  - GTE\n",
     ['3: unknown method "GTE"; did you mean GET? use a standard HTTP method (GET, HEAD, POST, '
      "PUT, PATCH, DELETE, OPTIONS, ...) or a registered one in uppercase (PROPFIND, ...), or "
      "omit methods to allow every method"]),
    ("host: a.test\nmethods: []\n", ["2: methods is empty; list methods (e.g. [GET]) or omit it "
                                     "for all"]),
    ("host: a.test\nmethods: ['*']\n",
     ['2: invalid method "*"; omit methods to allow every method']),
    ("host: a.test\npaths: [v1]\n", ["2: path pattern 'v1' must start with '/'"]),
    ("host: a.test\npaths: []\n", ['2: paths is empty; list path patterns (e.g. ["/v1/**"]) '
                                   "or omit it"]),
    ("host: a.test\ninspect: maybe\n", ["2: inspect must be true or false"]),
    ("host: a.test\nprotocol: udp\n", ["2: invalid protocol 'udp'; use http or tcp"]),
    ("host: a.test\nprotocol: tcp\n", ["2: protocol: tcp needs explicit ports (e.g. ports: "
                                       "[22])"]),
    ("host: a.test\nprotocol: tcp\nports: [22]\nmethods: [GET]\ninspect: true\n",
     ["2: protocol: tcp cannot be combined with methods, inspect (raw TCP is not inspected); "
      "remove them or use protocol: http"]),
    ("host: a.test\nmodels: [gpt]\n",
     ["2: models needs credential: on the same rule (the allowlist applies to inference calls "
      "the gateway injects a key into); add credential: or remove models"]),
    ("host: a.test\ncredential: k\nmodels: ['a b']\n",
     ["3: invalid model pattern 'a b'; use a model name or a glob such as \"claude-sonnet-*\" "
      "(printable ASCII, no spaces)"]),
    ("host: a.test\ncredential: k\nmodels: []\n",
     ['3: models is empty; list model globs (e.g. ["gpt-4o-mini"]) or omit it to allow every '
      "model"]),
    ("host: a.test\nmetering: required\n",
     ["2: metering needs credential: on the same rule (it applies to inference calls the "
      "gateway injects a key into); add credential: or remove metering"]),
    ("host: a.test\nunmetered: [/x]\nallow_minted_secrets: true\n",
     ["3: allow_minted_secrets needs credential: on the same rule (it applies to inference "
      "calls the gateway injects a key into); add credential: or remove allow_minted_secrets",
      "2: unmetered needs credential: on the same rule (it applies to inference calls the "
      "gateway injects a key into); add credential: or remove unmetered"]),
    ("host: a.test\naction: block\nreason: no\n", ["2: invalid action 'block'; use allow or deny"]),
    ("host: a.test\naction: deny\ncredential: k\ninspect: true\n",
     ["2: action: deny cannot be combined with credential, inspect (a deny rule allows "
      "nothing); remove them"]),
    ("host: a.test\nreason: because\n",
     ["2: reason is for action: deny rules (it is what a refused request is told); add "
      "action: deny or remove reason"]),
    ("host: a.test\naction: deny\nreason: " + "x" * 301 + "\n",
     ["3: reason must be 1-300 characters"]),
    ("host: a.test\nmcp: [a]\n", ["2: mcp must be a mapping (key: value)"]),
    ("host: a.test\ncredential: k\nmcp:\n  oauth: {}\n",
     ["2: credential and mcp.oauth on one rule: with mcp.oauth the gateway attaches the "
      "server's own OAuth token; remove credential: (or oauth:)"]),
    ("- a.test\n", ["1: an egress rule must be a mapping (key: value)"]),
]


@pytest.mark.parametrize(("text", "problems"), REFUSED)
def test_what_is_refused_and_where(text: str, problems: list[str]) -> None:
    assert read(read_rule, text, "team") == (None, problems)


REPORTED = [
    ("host: a.test\nask: {hosts: true}\n", rule(host="a.test", ask=Ask()),
     ['2: unknown key "hosts" in ask; known keys: timeout, notify']),
    ("host: a.test\ntelemetry: true\n", rule(host="a.test"),
     ['2: unknown key "telemetry" in an egress rule; known keys: host, ports, methods, paths, '
      "credential, inspect, protocol, models, metering, allow_minted_secrets, action, reason, "
      "mcp, ask, unmetered, dlp"]),
    ("{host: a.test, port: [443]}", rule(host="a.test"),
     ['1: unknown key "port" in an egress rule (did you mean "ports"?); known keys: host, '
      "ports, methods, paths, credential, inspect, protocol, models, metering, "
      "allow_minted_secrets, action, reason, mcp, ask, unmetered, dlp"]),
]


@pytest.mark.parametrize(("text", "want", "problems"), REPORTED)
def test_an_unknown_key_is_reported_and_the_rest_read(text: str, want: Rule,
                                                      problems: list[str]) -> None:
    """(A load with any problem fails: what the reader returned is never used.)"""
    assert read(read_rule, text, "team") == (RawRule(want, 1), problems)


def test_a_shipped_preset_marks_its_telemetry_rules() -> None:
    raw, problems = read(read_rule, "{host: t.test, telemetry: true}", "agent/x", preset=True)
    assert problems == [] and raw.telemetry and raw.rule.policy == "agent/x"
    _, problems = read(read_rule, "{host: t.test, telemetry: true, action: deny}", "agent/x",
                       preset=True)
    assert problems == ["1: a telemetry rule is allowed or denied by the preset's switch: "
                        "remove action"]


METERING = [
    ("required", MeteringRule(), []),
    ("{required: false, reserve: 1000}", MeteringRule(required=False, reserve=1000), []),
    ("{max_input_tokens: 200000}", MeteringRule(max_input_tokens=200_000), []),
    ("sometimes", None, ["1: invalid metering 'sometimes'; use required, optional or "
                         "{required: true, reserve: <output tokens>}"]),
    ("{reserve: 0}", None, ["1: metering.reserve must be a positive whole number of output "
                            "tokens (what a call without max_tokens reserves)"]),
    ("{required: 1}", None, ["1: metering.required must be true or false"]),
]


@pytest.mark.parametrize(("text", "want", "problems"), METERING)
def test_metering(text: str, want: MeteringRule | None, problems: list[str]) -> None:
    assert read(read_metering, text) == (want, problems)


EGRESS = [
    ("~", [], []),
    ("[]", [], []),
    ("{host: a.test}", [], ["1: egress must be a list of rules (- host: ...)"]),
    ("- host: a.test\n- host: 'b c'\n- host: c.test\n", ["a.test", "c.test"],
     ["2: host pattern 'b c' contains whitespace; remove it"]),
]


@pytest.mark.parametrize(("text", "hosts", "problems"), EGRESS)
def test_the_section(text: str, hosts: list[str], problems: list[str]) -> None:
    rules, found = read(read_egress, text, "team")
    assert ([r.rule.host for r in rules], found) == (hosts, problems)


FILE_TO_DECISION = """\
- {host: api.example.com, methods: [GET], paths: ["/v1/**"], credential: k}
- {host: api.example.com, action: deny, reason: read only}
- {host: "*.cdn.example.com"}
"""

# (method, host, path, result, the line of the rule that decided, credential)
DECISIONS = [
    ("GET", "api.example.com", "/v1/models", "allow", 1, "k"),
    ("POST", "api.example.com", "/v1/models", "deny", 2, None),
    ("GET", "img.cdn.example.com", "/a.png", "allow", 3, None),
    ("GET", "elsewhere.example", "/", "deny", None, None),
]


@pytest.mark.parametrize(("method", "host", "path", "result", "line", "credential"),
                         DECISIONS)
def test_from_the_file_to_the_decision(method: str, host: str, path: str, result: str,
                                       line: int | None, credential: str | None) -> None:
    """The rules read are what the matcher decides with: their sources are the lines."""
    rules, problems = read(read_egress, FILE_TO_DECISION, "team")
    assert problems == []
    key = Credential(name="k", secret="s", hosts=("api.example.com",),
                     injection=Injection("bearer"))
    policy = compile_policy("team", [r.rule for r in rules], credentials={"k": key})
    decision = decide(policy, Request(method, "https", host, 443, path))
    assert decision.result == result
    assert (decision.rule.source if decision.rule else None) == (
        f"{FILE}:{line}" if line else None)
    assert decision.credential == credential
