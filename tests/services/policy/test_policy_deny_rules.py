"""`action: deny` rules and the paths tier of specificity: tables of requests and what
the matcher decides (the same matcher serves the proxy, explain, test and replay)."""

from __future__ import annotations

import pytest

from gateway.core.policy import Request, decide
from gateway.services.policy import PolicyError, load_policy_text

POLICY = """\
version: v1
name: p
egress:
  - host: api.example.com                       # 4: the host's key-carrying rule
    credential: example
  - host: api.example.com                       # 6: keyless public paths
    methods: [GET]
    paths: [/public/**]
  - host: api.example.com                       # 9: refused paths
    paths: [/admin/**]
    action: deny
    reason: the admin API is for people, not agents
  - host: files.example.com                     # 13: passthrough, one path refused
  - host: files.example.com
    paths: [/private/**]
    action: deny
  - host: "*.tracker.example"                   # 17: a whole domain refused
    action: deny
  - host: ok.tracker.example                    # 19: ... but this host allowed
  - host: only-denied.example
    paths: [/x]
    action: deny
credentials:
  example: {hosts: [api.example.com], secret: k, inject: {bearer: true}}
"""


@pytest.fixture(scope="module")
def policy():  # type: ignore[no-untyped-def]
    return load_policy_text("policies/p.yaml", POLICY).policies["p"]


REQUESTS = [
    # (host, method, path) -> (result, credential, rule line, inspect at tunnel level)
    (("api.example.com", "POST", "/v1/run"), ("allow", "example", 4)),
    (("api.example.com", "GET", "/public/list"), ("allow", None, 6)),
    (("api.example.com", "POST", "/public/list"), ("allow", "example", 4)),
    (("api.example.com", "GET", "/admin/users"), ("deny", None, 9)),
    # a path the deny rule cannot read is refused by it (never allowed past it)
    (("api.example.com", "GET", "/admin/../admin/users"), ("deny", None, 9)),
    (("api.example.com", "GET", "/x/../admin/users"), ("deny", None, 9)),
    (("api.example.com", "GET", "/admin%2fusers"), ("deny", None, 9)),
    (("files.example.com", "GET", "/x/../private/key"), ("deny", None, 14)),
    (("files.example.com", "GET", "/readme"), ("allow", None, 13)),
    (("files.example.com", "GET", "/private/key"), ("deny", None, 14)),
    (("a.tracker.example", "GET", "/"), ("deny", None, 17)),
    (("ok.tracker.example", "GET", "/"), ("allow", None, 19)),
]


@pytest.mark.parametrize(("request_", "expected"), REQUESTS, ids=lambda v: str(v))
def test_request_decisions(policy, request_, expected) -> None:  # type: ignore[no-untyped-def]
    host, method, path = request_
    decision = decide(policy, Request(host=host, port=443, scheme="https", method=method,
                                      path=path))
    result, credential, line = expected
    assert (decision.result, decision.credential) == (result, credential), decision.reason
    assert decision.rule is not None and decision.rule.source == f"policies/p.yaml:{line}"


def test_a_deny_reason_is_what_the_refusal_says(policy) -> None:  # type: ignore[no-untyped-def]
    decision = decide(policy, Request(host="api.example.com", port=443, scheme="https",
                                      method="GET", path="/admin/x"))
    assert decision.reason == ("refused by rule policies/p.yaml:9: the admin API is for "
                               "people, not agents")
    unexplained = decide(policy, Request(host="files.example.com", port=443, scheme="https",
                                         method="GET", path="/private/x"))
    assert "remove or narrow that rule" in unexplained.reason


TUNNELS = [
    # host -> (result, inspect): a deny rule on paths makes a passthrough host inspected
    ("files.example.com", ("allow", True)),
    ("a.tracker.example", ("deny", False)),
    ("ok.tracker.example", ("allow", False)),
    ("only-denied.example", ("deny", False)),
    ("api.example.com", ("allow", True)),
]


@pytest.mark.parametrize(("host", "expected"), TUNNELS)
def test_tunnel_decisions(policy, host, expected) -> None:  # type: ignore[no-untyped-def]
    decision = decide(policy, Request(host=host, port=443, scheme="https", method=None,
                                      path=None))
    assert (decision.result, decision.inspect) == expected, decision.reason


def test_report_mode_reports_a_deny_rule() -> None:
    text = POLICY.replace("name: p\n", "name: p\nmode: report\n")
    policy = load_policy_text("policies/p.yaml", text).policies["p"]
    decision = decide(policy, Request(host="a.tracker.example", port=443, scheme="https",
                                      method="GET", path="/"))
    assert decision.result == "report" and "refused by rule" in decision.reason


ERRORS = [
    ("    action: deny\n    credential: example\n",
     "action: deny cannot be combined with credential"),
    ("    reason: why\n", "reason is for action: deny rules"),
    ("    action: block\n", "invalid action 'block'; use allow or deny"),
    ("    telemetry: true\n", "unknown key"),
]


@pytest.mark.parametrize(("extra", "message"), ERRORS)
def test_rule_errors(extra: str, message: str) -> None:
    text = ("version: v1\nname: p\negress:\n  - host: api.example.com\n" + extra +
            "credentials:\n  example: {hosts: [api.example.com], secret: k, "
            "inject: {bearer: true}}\n")
    with pytest.raises(PolicyError) as info:
        load_policy_text("policies/p.yaml", text)
    assert message in str(info.value)
