"""Decisions: tunnel level, request level, specificity, report mode, reasons, explain, cost."""

from __future__ import annotations

import asyncio
import statistics
import time
import tracemalloc
from dataclasses import dataclass

import pytest

from gateway.core.policy import (
    Credential,
    Decision,
    Injection,
    Policy,
    PolicySet,
    Request,
    Rule,
    compile_policy,
    decide,
)
from gateway.services.policy import load_policy_text
from gateway.tools.explain import explain_request

POLICY = """\
version: v1
name: agent
egress:
  - host: pypi.org                                      # 4
  - host: "*.pythonhosted.org"                          # 5
  - host: api.github.com                                # 6
    ports: [443]
    methods: [GET, HEAD]
    paths: ["/repos/**"]
  - host: api.openai.com                                # 10
    credential: openai
    paths: ["/v1/chat/completions", "/v1/responses"]
  - host: api.openai.com                                # 13
  - host: github.com                                    # 14
    ports: [22]
    protocol: tcp
  - host: registry.npmjs.org                            # 17
    inspect: true
  - host: "**.example.com"                              # 19
    methods: [GET]
  - host: "api.example.com"                             # 21
    ports: [8443]
  - host: "*.corp.example"                              # 23
    credential: corp
  - host: 10.1.2.3                                      # 25
    ports: [80, 8080]
  - host: "2001:db8::1"                                 # 27
credentials:
  openai: {preset: openai, secret: openai-key}
  corp: {hosts: [llm.corp.example], secret: corp-key, inject: {bearer: true}}
"""


@pytest.fixture(scope="module")
def policy_set() -> PolicySet:
    return load_policy_text("policies/agent.yaml", POLICY)


@pytest.fixture(scope="module")
def policy(policy_set: PolicySet) -> Policy:
    return policy_set.policies["agent"]


@dataclass(frozen=True)
class Case:
    request: Request
    result: str
    line: int | None = None  # source line of the deciding rule
    inspect: bool = False
    credential: str | None = None
    reason: str = ""


def tunnel(host: str, port: int = 443, scheme: str = "https") -> Request:
    return Request(None, scheme, host, port, None)


def req(method: str, url_host: str, path: str, port: int = 443, scheme: str = "https") -> Request:
    return Request(method, scheme, url_host, port, path)


TUNNEL_CASES = [
    Case(tunnel("pypi.org"), "allow", 4, inspect=False),
    Case(tunnel("pypi.org", 80), "allow", 4, inspect=False),
    Case(tunnel("files.pythonhosted.org"), "allow", 5, inspect=False),
    Case(tunnel("api.github.com"), "allow", 6, inspect=True),
    # a credential rule on the host forces interception despite the host-only rule
    Case(tunnel("api.openai.com"), "allow", 10, inspect=True),
    Case(tunnel("github.com", 22), "allow", 14, inspect=False),
    Case(tunnel("github.com", 22, "tcp"), "allow", 14, inspect=False),
    Case(tunnel("registry.npmjs.org"), "allow", 17, inspect=True),
    Case(tunnel("api.example.com", 8443), "allow", 21, inspect=False),
    Case(tunnel("example.com"), "allow", 19, inspect=True),
    Case(tunnel("llm.corp.example"), "allow", 23, inspect=True),
    Case(tunnel("10.1.2.3", 8080), "allow", 25, inspect=False),
    Case(tunnel("2001:db8::1"), "allow", 27, inspect=False),
    Case(
        tunnel("evil.example"),
        "deny",
        None,
        reason='no rule in policy "agent" allows host "evil.example"; add an egress rule with '
        "host: evil.example to policies/agent.yaml",
    ),
    Case(
        tunnel("169.254.169.254", 80),
        "deny",
        None,
        reason="169.254.169.254 is a link-local (cloud metadata) address (169.254.169.254/32): "
        "the gateway never connects to it, whatever a policy or network.allow_cidrs says; no "
        "rule can allow it",
    ),
    Case(tunnel("fd00:ec2::254"), "deny", None, reason="no rule can allow it"),
    Case(
        tunnel("10.9.9.9"),
        "deny",
        None,
        reason='no rule in policy "agent" allows host "10.9.9.9"; add an egress rule with '
        "host: 10.9.9.9 to policies/agent.yaml; 10.9.9.9 is not a public address (private "
        "range, 10.0.0.0/8), so the gateway's network.allow_cidrs must also include it",
    ),
    Case(
        tunnel("pypi.org", 8443),
        "deny",
        4,
        reason="port 8443 is not allowed for pypi.org by rule policies/agent.yaml:4, which "
        "allows only the default ports 443 (https) and 80 (http); add ports: [8443] to it",
    ),
    Case(
        tunnel("github.com", 443),
        "deny",
        14,
        reason="port 443 is not allowed for github.com by rule policies/agent.yaml:14 "
        "(ports: 22); add 443 to its ports",
    ),
    Case(tunnel("pypi.org", 443, "tcp"), "deny", 4, reason="needs a rule with protocol: tcp"),
    # credential rule whose credential is not bound to this host: not a match
    Case(tunnel("other.corp.example"), "deny", 23, reason="credential corp of rule"),
    Case(tunnel("10.1.2.3", 443), "deny", 25, reason="(ports: 80, 8080)"),
    Case(tunnel("xn--e1aybc.example.com"), "allow", 19, inspect=True),
    Case(tunnel("pythonhosted.org"), "deny", None),
]

REQUEST_CASES = [
    Case(req("GET", "pypi.org", "/simple/x/"), "allow", 4),
    Case(req("POST", "pypi.org", "/anything?q=1", 80, "http"), "allow", 4),
    Case(req("GET", "pypi.org", "/", 443, "http"), "deny", 4, reason="port 443 (http)"),
    Case(req("GET", "pypi.org", "/", 80, "https"), "deny", 4, reason="port 80 (https)"),
    Case(req("GET", "api.github.com", "/repos/a/b?x=1"), "allow", 6),
    Case(req("HEAD", "api.github.com", "/repos"), "allow", 6),
    Case(
        req("POST", "api.github.com", "/repos/a/b"),
        "deny",
        6,
        reason="method POST is not allowed for api.github.com by rule policies/agent.yaml:6 "
        "(methods: GET, HEAD); add POST to its methods",
    ),
    Case(
        req("GET", "api.github.com", "/user"),
        "deny",
        6,
        reason='path "/user" is not allowed for api.github.com by rule policies/agent.yaml:6 '
        "(paths: /repos/**); add a matching pattern to its paths",
    ),
    # the credential rule wins over the host-only rule when its paths match
    Case(req("POST", "api.openai.com", "/v1/chat/completions"), "allow", 10, credential="openai"),
    Case(req("POST", "api.openai.com", "/v1/responses?stream=1"), "allow", 10, credential="openai"),
    # elsewhere on the host the host-only rule allows, without the credential
    Case(req("GET", "api.openai.com", "/v1/models"), "allow", 13),
    # suspicious paths match no rule with paths or a credential: only the host-only one,
    # which allows every path of the host (without the key)
    Case(req("POST", "api.openai.com", "/v1/x/../chat/completions"), "allow", 13),
    Case(req("GET", "api.openai.com", "/v1/a%2fb"), "allow", 13),
    Case(req("GET", "api.github.com", "/repos/x/../y"), "deny", 6,
         reason="contains a '.' or '..' segment, so no rule matches it"),
    Case(req("GET", "api.github.com", "/repos/a%2fb"), "deny", 6, reason="encoded '/'"),
    Case(req("GET", "api.github.com", "/repos\\x"), "deny", 6, reason="backslash"),
    Case(req("GET", "registry.npmjs.org", "/@scope%2fname"), "allow", 17),
    Case(req("GET", "github.com", "/", 22), "deny", 14, reason="only for raw TCP"),
    Case(req("GET", "registry.npmjs.org", "/left-pad"), "allow", 17),
    Case(req("GET", "deep.sub.example.com", "/"), "allow", 19),
    Case(req("DELETE", "example.com", "/"), "deny", 19, reason="method DELETE"),
    # exact host is more specific than the wildcard
    Case(req("POST", "api.example.com", "/", 8443), "allow", 21),
    Case(req("GET", "api.example.com", "/"), "allow", 19),
    Case(req("GET", "llm.corp.example", "/v1/chat"), "allow", 23, credential="corp"),
    Case(req("GET", "other.corp.example", "/"), "deny", 23, reason="not bound to"),
    Case(req("GET", "10.1.2.3", "/", 8080, "http"), "allow", 25),
    Case(req("GET", "2001:db8::1", "/"), "allow", 27),
    Case(req("GET", "evil.example", "/"), "deny", None, reason="no rule in policy"),
    Case(req("get", "api.github.com", "/repos/x"), "deny", 6, reason="method get"),
]


def check(policy: Policy, case: Case) -> Decision:
    decision = decide(policy, case.request)
    assert decision.result == case.result, decision
    assert decision.allowed is (case.result != "deny")
    if case.line is None:
        assert decision.rule is None
    else:
        assert decision.rule is not None
        assert decision.rule.source == f"policies/agent.yaml:{case.line}", decision
    assert case.reason in decision.reason
    assert len(decision.reason) < 320
    return decision


@pytest.mark.parametrize("case", TUNNEL_CASES, ids=lambda c: f"{c.request.host}:{c.request.port}")
def test_tunnel_level(policy: Policy, case: Case) -> None:
    decision = check(policy, case)
    assert decision.inspect is case.inspect
    assert decision.credential is None


@pytest.mark.parametrize(
    "case",
    REQUEST_CASES,
    ids=lambda c: f"{c.request.method} {c.request.host}:{c.request.port}{c.request.path}",
)
def test_request_level(policy: Policy, case: Case) -> None:
    decision = check(policy, case)
    assert decision.credential == case.credential
    assert decision.inspect is False


def test_report_mode(policy_set: PolicySet) -> None:
    report = load_policy_text("r.yaml", POLICY.replace("name: agent", "name: r\nmode: report"))
    policy = report.policies["r"]
    denied = decide(policy, req("POST", "api.github.com", "/repos/a"))
    assert denied.result == "report" and denied.allowed
    assert "method POST is not allowed" in denied.reason
    assert denied.credential is None
    unknown = decide(policy, tunnel("evil.example"))
    assert unknown.result == "report" and unknown.inspect is False
    allowed = decide(policy, req("GET", "api.github.com", "/repos/a"))
    assert allowed.result == "allow"


LEARN = """\
version: v1
name: learner
mode: learn
egress:
  - host: api.github.com
    methods: [GET]
credentials:
  mine: {hosts: [api.example.net], secret: k, inject: {bearer: true}}
  twin: {hosts: ["*.twins.example"], secret: k, inject: {bearer: true}}
  twin2: {hosts: ["a.twins.example"], secret: k, inject: {bearer: true}}
---
version: v1
name: other
egress: [{host: x.example}]
credentials:
  theirs: {hosts: [api.theirs.example], secret: k, inject: {bearer: true}}
"""


@pytest.mark.parametrize(("request_", "result", "inspect", "credential", "rule"), [
    # what a rule allows is allowed as it would be
    (req("GET", "api.github.com", "/repos/a"), "allow", False, None, "l.yaml:5"),
    # a method the rule refuses: recorded, its closest rule named
    (req("POST", "api.github.com", "/repos/a"), "report", False, None, "l.yaml:5"),
    # a host no rule names: the tunnel is intercepted so its requests are seen
    (tunnel("pypi.org"), "report", True, None, None),
    (Request(None, "tcp", "db.example", 5432, None), "report", False, None, None),
    # the one credential of the policy bound to the host is injected, by a stand-in rule
    (req("POST", "api.example.net", "/v1/x"), "report", False, "mine",
     "l.yaml (mode: learn)"),
    # two bound: none (which one a policy needs is not guessed)
    (req("GET", "a.twins.example", "/"), "report", False, None, None),
    (req("GET", "b.twins.example", "/"), "report", False, "twin", "l.yaml (mode: learn)"),
    # another policy's credential is never injected
    (req("GET", "api.theirs.example", "/"), "report", False, None, None),
])
def test_learn_mode(request_: Request, result: str, inspect: bool, credential: str | None,
                    rule: str | None) -> None:
    policy = load_policy_text("l.yaml", LEARN).policies["learner"]
    decision = decide(policy, request_)
    assert (decision.result, decision.inspect, decision.credential) == (
        result, inspect, credential)
    assert (decision.rule.source if decision.rule else None) == rule
    assert policy.credential_names == ("mine", "twin", "twin2")  # a token's default scope


def test_learning_puts_every_policy_in_learn_mode(policy_set: PolicySet) -> None:
    from gateway.core.policy.compiled import learning
    learned = learning(policy_set)
    assert {p.mode for p in learned.policies.values()} == {"learn"}
    decision = decide(learned.policies["agent"], tunnel("evil.example"))
    assert (decision.result, decision.inspect) == ("report", True)


def test_learning_keeps_what_a_policy_says_besides_its_mode() -> None:
    """`run --learn` recompiles every policy; its dlp: (secrets leaving are still refused
    in learn mode), budgets, ask and telemetry settings come along."""
    from gateway.core.policy.compiled import learning
    text = ("version: v1\nname: p\ndlp: {action: refuse}\ntelemetry: {content: true}\n"
            "egress:\n  - host: api.example.com\n")
    before = load_policy_text("p.yaml", text)
    after = learning(before).policies["p"]
    was = before.policies["p"]
    assert after.mode == "learn"
    assert (after.dlp, after.telemetry_content, after.budgets, after.ask) == (
        was.dlp, was.telemetry_content, was.budgets, was.ask)
    assert after.dlp is not None and after.dlp.enabled


def test_long_inputs_are_clipped(policy: Policy) -> None:
    host = "a" * 60 + "." + "b" * 60 + ".example.net"
    decision = decide(policy, req("GET", host, "/"))
    assert len(decision.reason) < 320
    decision = decide(policy, req("GET", "api.github.com", "/" + "x" * 5000))
    assert decision.result == "deny" and len(decision.reason) < 320


def test_allow_decisions_are_precomputed(policy: Policy) -> None:
    a = decide(policy, req("GET", "pypi.org", "/a"))
    b = decide(policy, req("GET", "pypi.org", "/b"))
    assert a is b


def test_specificity_order_without_credentials() -> None:
    rules = [
        Rule(host="**.example.com", source="f:1", methods=("GET",)),
        Rule(host="*.example.com", source="f:2", methods=("GET", "POST")),
        Rule(host="api*.example.com", source="f:3", methods=("GET", "POST", "PUT")),
        Rule(host="*.api.example.com", source="f:4"),
        Rule(host="v1.api.example.com", source="f:5", methods=("PATCH",)),
    ]
    policy = compile_policy("p", rules)

    def winner(method: str, host: str) -> str | None:
        rule = decide(policy, req(method, host, "/")).rule
        return rule.source if rule else None

    assert winner("GET", "v1.api.example.com") == "f:4"  # more literal labels first
    assert winner("PATCH", "v1.api.example.com") == "f:5"  # exact host first
    assert winner("GET", "api2.example.com") == "f:3"  # glob before *. before **.
    assert winner("POST", "x.example.com") == "f:2"
    assert winner("GET", "example.com") == "f:1"
    assert decide(policy, req("DELETE", "x.example.com", "/")).rule == rules[1]  # closest


def test_compile_policy_rejects_unknown_credential() -> None:
    with pytest.raises(ValueError, match="unknown credential"):
        compile_policy("p", [Rule(host="a.example.com", credential="nope")])
    cred = Credential(name="k", secret="s", hosts=("a.example.com",), injection=Injection("bearer"))
    policy = compile_policy(
        "p", [Rule(host="a.example.com", credential="k")], credentials={"k": cred}
    )
    assert decide(policy, req("GET", "a.example.com", "/")).credential == "k"


def test_empty_policy_denies_everything() -> None:
    policy = compile_policy("empty", [], source="policies/empty.yaml")
    decision = decide(policy, tunnel("pypi.org"))
    assert decision.result == "deny"
    assert "add an egress rule with host: pypi.org to policies/empty.yaml" in decision.reason


def explain(policy_set: PolicySet, policy_name: str, method: str, url: str) -> Decision:
    """`policy explain`'s decision (the decision pipeline, no destination check)."""
    return asyncio.run(explain_request(policy_set, policy_name, method, url, None)).decision


@pytest.mark.parametrize(
    ("method", "url", "result", "line", "credential"),
    [
        ("GET", "https://api.github.com/repos/a", "allow", 6, None),
        ("get", "api.github.com/repos/a", "allow", 6, None),
        ("POST", "https://API.OpenAI.com./v1/chat/completions?x=1", "allow", 10, "openai"),
        ("GET", "http://pypi.org/simple", "allow", 4, None),
        ("GET", "http://pypi.org:8080/simple", "deny", 4, None),
        ("GET", "https://[2001:db8::1]/", "allow", 27, None),
        ("GET", "http://10.1.2.3:8080", "allow", 25, None),
        ("GET", "https://тест.example.com/", "allow", 19, None),
        ("GET", "https://evil.example/", "deny", None, None),
    ],
)
def test_explain(
    policy_set: PolicySet,
    method: str,
    url: str,
    result: str,
    line: int | None,
    credential: str | None,
) -> None:
    decision = explain(policy_set, "agent", method, url)
    assert decision.result == result, decision
    assert (decision.rule.source if decision.rule else None) == (
        f"policies/agent.yaml:{line}" if line else None
    )
    assert decision.credential == credential


@pytest.mark.parametrize(
    ("policy_name", "url", "message"),
    [
        ("nope", "https://a.example.com/", "unknown policy 'nope' (known: agent)"),
        ("agent", "ftp://a.example.com/", "unsupported URL scheme"),
        ("agent", "https://a.example.com:99999/", "invalid URL"),
        ("agent", "https:///x", "invalid URL"),
    ],
)
def test_explain_errors(policy_set: PolicySet, policy_name: str, url: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        explain(policy_set, policy_name, "GET", url)
    assert message in str(info.value)


def _median_ns(policy: Policy, requests: list[Request], rounds: int) -> float:
    samples: list[int] = []
    clock = time.perf_counter_ns
    for _ in range(rounds):
        start = clock()
        for request in requests:
            decide(policy, request)
        samples.append(clock() - start)
    return statistics.median(samples) / len(requests)


def _big_policy(n: int) -> Policy:
    rules: list[Rule] = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            rules.append(Rule(host=f"h{i}.svc{i % 97}.example.com"))
        elif kind == 1:
            rules.append(Rule(host=f"*.w{i}.example.org", methods=("GET",)))
        elif kind == 2:
            rules.append(Rule(host=f"api{i}.example.net", paths=("/v1/**", "/v2/x")))
        else:
            rules.append(Rule(host=f"**.d{i}.example.io", ports=(443, 8443)))
    return compile_policy(f"p{n}", rules)


def test_decision_cost_does_not_grow_with_rules() -> None:
    """10 vs 100,000 rules: the indexed matcher stays within ~3x (in practice ~1x)."""
    small, big = _big_policy(10), _big_policy(100_000)
    # the same requests against both: hits on each rule kind, and misses
    requests = [
        req("GET", "h4.svc4.example.com", "/x"),
        req("GET", "a.b.w5.example.org", "/"),
        req("POST", "api6.example.net", "/v1/chat/completions"),
        req("GET", "d7.example.io", "/", 8443),
        req("GET", "nothing.example.com", "/"),
        req("GET", "deep.er.miss.example.org", "/"),
        tunnel("a.w9.example.org"),
        tunnel("evil.example"),
    ]
    for request in requests[:4]:
        assert decide(big, request).result == "allow"
        assert decide(small, request).result == "allow"
    _median_ns(big, requests, 50)  # warm up
    t_small = _median_ns(small, requests, 300)
    t_big = _median_ns(big, requests, 300)
    assert t_big < 3 * t_small, (t_small, t_big)


def _first_requests(n: int) -> list[Request]:
    """One request each rule of ``_big_policy(n)`` allows, then one tunnel each."""
    requests: list[Request] = []
    for i in range(n):
        host, port, path = [(f"h{i}.svc{i % 97}.example.com", 443, "/x"),
                            (f"a.w{i}.example.org", 443, "/"),
                            (f"api{i}.example.net", 443, "/v1/x"),
                            (f"x.d{i}.example.io", 8443, "/")][i % 4]
        requests.append(req("GET", host, path, port))
    return requests + [tunnel(r.host, r.port) for r in requests]


def test_a_first_decision_on_a_rule_allocates_nothing() -> None:
    """At 100,000 rules most decisions are the first on their rule: it builds nothing (its
    allow decisions come with the index, their reason is formatted when first read), so it
    keeps no memory and adds no object for the young collections to walk (issue 41: the
    first decisions' p99; before, each built a decision and formatted its reason)."""
    n = 2000
    policy = _big_policy(n)
    requests = _first_requests(n)
    decisions: list[Decision | None] = [None] * len(requests)  # (no list growth below)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i, request in enumerate(requests):
            decisions[i] = decide(policy, request)
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert all(d is not None and d.result == "allow" for d in decisions)
    # (now a few hundred bytes in all; the bound leaves room for another thread's
    # allocations, traced too; before: ~180 bytes a decision)
    assert kept < 20 * len(requests), kept


def test_an_allow_reads_as_its_rule() -> None:
    """The reason formatted on first read is the allow's sentence, cut at 280 characters,
    and the decision equals one built with that text."""
    long_paths = tuple(f"/v1/{'p' * 40}/{i}/**" for i in range(8))
    rules = [Rule(host="api.example.com", source="p.yaml:4", paths=("/v1/**",),
                  methods=("GET",)),
             Rule(host="long.example.com", source="p.yaml:9", paths=long_paths)]
    policy = compile_policy("p", rules)
    for rule, request in zip(rules, (req("GET", "api.example.com", "/v1/x"),
                                     req("GET", "long.example.com", "/v1/" + "p" * 40 + "/3/x")),
                             strict=True):
        decision = decide(policy, request)
        text = f"allowed by rule {rule.source} ({rule.describe()})"
        expected = text if len(text) <= 280 else text[:277] + "..."
        assert decision.reason == expected and len(decision.reason) <= 280
        assert decision == Decision("allow", expected, rule, False, None)
        assert hash(decision) == hash(Decision("allow", expected, rule, False, None))
        assert "reason='allowed by rule" in repr(decision)
    assert len(expected) == 280  # (the long rule's was cut)
