"""Ask mode in the gate, from fakes: what is askable (and what never is), what a grant
or an answer makes of the decision, the codes of a person's no and of silence, and the
sweep that ends a revoked grant's tunnels. The policy is real; the approvals port is a
fake that answers as each row says."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from gateway.core.approvals import Approval, Asked, Grant
from gateway.core.client import Client, Refused, Tunnel
from gateway.core.identity import Identity
from gateway.core.messages import Headers, RequestHead
from gateway.core.policy import PolicySet, Request
from gateway.core.policy.ask_rule import Ask
from gateway.core.refusal import Answer, Refusal
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.gate import Gate
from gateway.services.policy import load_policy_texts
from tests.pipeline.test_pipeline_gate import (
    GOOD,
    PEER,
    Guard,
    Health,
    Registry,
    Secrets,
    Tokens,
    _basic,
)

POLICY = """\
version: v1
name: agent
ask: {hosts: true, requests: true, timeout: 30s}
egress:
  - host: allowed.test
    methods: [GET]
    paths: ["/ok"]
  - host: denied.test
    action: deny
    reason: not this one
  - host: api.openai.com
    credential: openai
    models: ["gpt-4o-mini", "gpt-4.1-*"]
  - host: asks.test
    ask: true
  - host: asks-per-request.test
    methods: [GET]
    ask: {timeout: 5s}
credentials:
  openai: {preset: openai, secret: openai-api-key, hosts: [api.openai.com]}
"""
NARROW = POLICY.replace("ask: {hosts: true, requests: true, timeout: 30s}",
                        "ask: {requests: true}")


@dataclass
class Approvals:
    """The port: answers every ask with `state` (and remembers what was asked)."""

    state: str = "approved"
    scope: str = "once"
    grants: list[Grant] = field(default_factory=list)
    asked: list[tuple[Asked, str, Ask]] = field(default_factory=list)
    written: Grant | None = None

    def grant_for(self, sandbox: str, policy: str, request: Request,
                  model: str | None = None) -> Grant | None:
        return next((g for g in self.grants
                     if g.covers(sandbox, policy, request, time.time(), model)), None)

    def active(self, grant: str) -> bool:
        return any(g.id == grant for g in self.grants)

    async def ask(self, identity: Identity, asked: Asked, reason: str, spec: Ask, *,
                  request: Request, model: str | None = None) -> Approval | Grant:
        self.asked.append((asked, reason, spec))
        assert asked.covers(request, model)  # (what is asked covers the held request)
        if self.written is not None:  # a grant written meanwhile, for something else
            return self.written
        now = time.time()
        return Approval(id=f"ap_{len(self.asked)}", sandbox=identity.sandbox,
                        policy=identity.policy, asked=asked, reason=reason, created=now,
                        expires=now + spec.timeout, state=self.state,  # type: ignore[arg-type]
                        scope=self.scope if self.state == "approved" else None, by="alice",
                        note="not now" if self.state == "denied" else None)


def _gate(text: str, approvals: Approvals) -> tuple[Gate, list[dict[str, Any]]]:
    policies: PolicySet = load_policy_texts({"policies/agent.yaml": text})
    lines: list[dict[str, Any]] = []

    async def resolve(host: str, port: int) -> list[str]:
        return ["203.0.113.7"]

    gate = Gate(tokens=Tokens(), policies=lambda: policies, guard=Guard(), secrets=Secrets(),
                registry=Registry(), audit=lines.append, resolve=resolve,
                audit_health=Health(), approvals=approvals)
    return gate, lines


async def _connect(gate: Gate, host: str) -> tuple[Client, Tunnel]:
    client = Client(PEER)
    tunnel = await gate.connect(client, f"{host}:443", _basic("sandbox-1", GOOD))
    return client, tunnel


async def _get(gate: Gate, host: str, path: str, *headers: tuple[str, str],
               method: str = "GET") -> Exchange | Answer:
    client, _ = await _connect(gate, host)
    return await gate.begin(client, RequestHead(method, path, Headers.of(("Host", host),
                                                                         *headers)), tls=True)


HOST = Asked("host", "new.test", 443)
# (name, policy, the port's answer, CONNECT or GET, host, path,
#  what is asked (None: nothing), the outcome: "allow <rule>" or the refusal's code)
ROWS: list[tuple[str, str, str, str, str, str, Asked | None, str]] = [
    ("a host no rule names, approved", POLICY, "approved", "CONNECT", "new.test", "",
     HOST, "allow grant:ap_1"),
    ("a host no rule names, declined", POLICY, "denied", "CONNECT", "new.test", "",
     HOST, "approval_denied"),
    ("a host no rule names, unanswered", POLICY, "timeout", "CONNECT", "new.test", "",
     HOST, "approval_timeout"),
    ("hosts not askable in this policy", NARROW, "approved", "CONNECT", "new.test", "",
     None, "policy_denied"),
    ("a deny rule is never asked", POLICY, "approved", "CONNECT", "denied.test", "",
     None, "policy_denied"),
    ("a forbidden destination is never asked", POLICY, "approved", "CONNECT",
     "169.254.169.254", "", None, "forbidden_destination"),
    ("an unresolvable name is never asked", POLICY, "approved", "CONNECT", "noname.test",
     "", None, "unresolvable"),
    ("a path the host's rule does not allow", POLICY, "approved", "GET", "allowed.test",
     "/other?q=1", Asked("request", "allowed.test", 443, "GET", "/other"),
     "allow grant:ap_1"),
    ("the same, declined", POLICY, "denied", "GET", "allowed.test", "/other", Asked(
        "request", "allowed.test", 443, "GET", "/other"), "approval_denied"),
    ("what a rule allows is not asked", POLICY, "denied", "GET", "allowed.test", "/ok",
     None, "allow policies/agent.yaml:5"),
    ("a rule with ask: asked at the CONNECT", POLICY, "approved", "CONNECT", "asks.test",
     "", Asked("host", "asks.test", 443), "allow grant:ap_1"),
    ("a rule with ask: declined", POLICY, "denied", "CONNECT", "asks.test", "",
     Asked("host", "asks.test", 443), "approval_denied"),
    ("a per-request rule with ask: asked per request", POLICY, "approved", "GET",
     "asks-per-request.test", "/x", Asked("request", "asks-per-request.test", 443, "GET",
                                          "/x"), "allow grant:ap_1"),
]


@pytest.mark.parametrize(("name", "text", "state", "method", "host", "path", "asked",
                          "outcome"), ROWS, ids=[r[0] for r in ROWS])
def test_what_is_asked_and_what_the_answer_makes(name: str, text: str, state: str,
                                                 method: str, host: str, path: str,
                                                 asked: Asked | None, outcome: str) -> None:
    approvals = Approvals(state=state)
    gate, lines = _gate(text, approvals)
    if method == "CONNECT":
        try:
            _, tunnel = asyncio.run(_connect(gate, host))
            got = f"allow {tunnel.decision.rule.source if tunnel.decision.rule else None}"
        except Refused as refused:
            got = refused.refusal.code
            assert lines[-1]["error"] == got and lines[-1]["decision"] == "deny"
    else:
        answer = asyncio.run(_get(gate, host, path))
        if isinstance(answer, Exchange):
            rule = answer.decision.rule
            got = f"allow {rule.source if rule else None}"
        else:
            got = answer.headers.get("x-sandbox-gateway-error") or str(answer.status)
    assert got == outcome
    assert [a for a, _, _ in approvals.asked] == ([asked] if asked else [])
    if outcome.startswith("approval_"):
        reason = lines[-1]["reason"]
        assert lines[-1]["rule"] == "approval:ap_1" and "ap_1" in reason
        assert ("alice" in reason and "not now" in reason and "do not retry" in reason) \
            if outcome == "approval_denied" else "within 30s" in reason


def _grant(asked: Asked, sandbox: str | None = "sandbox-1", expires: float = 3600) -> Grant:
    now = time.time()
    return Grant(id="gr_1", approval="ap_0", scope="sandbox" if sandbox else "policy",
                 policy="agent", sandbox=sandbox, asked=asked, by="bob", note=None,
                 created=now, expires=now + expires)


@pytest.mark.parametrize(("grant", "host", "path", "asks"), [
    (_grant(HOST), "new.test", "", False),
    (_grant(HOST, sandbox=None), "new.test", "", False),  # every sandbox of the policy
    (_grant(HOST, sandbox="sandbox-2"), "new.test", "", True),  # another sandbox's
    (_grant(HOST, expires=-1), "new.test", "", True),  # lapsed
    (_grant(Asked("host", "new.test", 8443)), "new.test", "", True),  # another port
    (_grant(Asked("request", "allowed.test", 443, "GET", "/other")), "allowed.test",
     "/other?page=2", False),
    (_grant(Asked("request", "allowed.test", 443, "GET", "/other")), "allowed.test",
     "/other/deeper", True),
], ids=["host", "policy-wide", "other sandbox", "expired", "other port", "request",
        "another path"])
def test_a_grant_stands_in_for_a_rule(grant: Grant, host: str, path: str,
                                      asks: bool) -> None:
    approvals = Approvals(state="denied", grants=[grant])
    gate, _ = _gate(POLICY, approvals)
    if path:
        got = asyncio.run(_get(gate, host, path))
        allowed = isinstance(got, Exchange) and got.decision.rule is not None and \
            got.decision.rule.source == "grant:gr_1"
    else:
        try:
            _, tunnel = asyncio.run(_connect(gate, host))
            assert tunnel.passthrough and tunnel.decision.rule is not None
            allowed = tunnel.decision.rule.source == "grant:gr_1"
        except Refused:
            allowed = False
    assert allowed is not asks and bool(approvals.asked) is asks


def test_a_key_or_token_to_the_host_is_refused_before_asking() -> None:
    """What the leak checks would refuse once approved is refused now: nobody is asked
    to approve something that could never be let through."""
    approvals = Approvals()
    gate, lines = _gate(POLICY, approvals)
    got = asyncio.run(_get(gate, "allowed.test", "/other", ("Authorization", f"Bearer {GOOD}")))
    assert isinstance(got, Answer) and got.headers.get("x-sandbox-gateway-error") == \
        "exfiltration_blocked"
    assert approvals.asked == [] and lines[-1]["error"] == "exfiltration_blocked"


def test_a_granted_rule_keeps_its_credential_and_inspection() -> None:
    """A rule with ask and a credential: approved, its key is still injected."""
    text = POLICY.replace("  - host: api.openai.com\n    credential: openai\n",
                          "  - host: api.openai.com\n    credential: openai\n    ask: true\n")
    approvals = Approvals()
    gate, _ = _gate(text, approvals)
    got = asyncio.run(_get(gate, "api.openai.com", "/v1/models",
                           ("Authorization", f"Bearer {GOOD}")))
    assert isinstance(got, Exchange) and got.credential == "openai"
    assert got.decision.rule is not None and got.decision.rule.source == "grant:ap_1"
    assert [a.kind for a, _, _ in approvals.asked] == ["host"]  # (the rule names no path)


def test_the_sweep_ends_tunnels_of_a_revoked_grant() -> None:
    grant = _grant(HOST)
    approvals = Approvals(grants=[grant])
    gate, _ = _gate(POLICY, approvals)
    ended: list[str] = []

    async def scenario() -> None:
        client, _ = await _connect(gate, "new.test")
        client.end = lambda: ended.append("ended")
        gate.connections.opened(client)
        assert gate.sweep() == 0
        approvals.grants = [replace(grant, id="gr_2")]
        assert gate.sweep() == 1 and client.ended_by == "grant_revoked"

    asyncio.run(scenario())
    assert ended == ["ended"]


MODELS = POLICY.replace("ask: {hosts: true, requests: true, timeout: 30s}",
                        "ask: {models: true, timeout: 30s}")
CHAT = ("POST", "/v1/chat/completions")


async def _chat(gate: Gate, model: str) -> tuple[Exchange, bytes | Refusal]:
    from gateway.services.metering import static_metering

    gate.metering = static_metering()
    got = await _get(gate, "api.openai.com", "/v1/chat/completions",
                     ("Authorization", f"Bearer {GOOD}"), ("Content-Type", "application/json"),
                     method="POST")
    assert isinstance(got, Exchange), got
    try:
        return got, await got.request_decided(
            b'{"model": "%s", "messages": []}' % model.encode())
    except Refusal as refusal:
        return got, refusal


@pytest.mark.parametrize(("text", "state", "model", "asked", "outcome"), [
    (MODELS, "approved", "gpt-5", "model gpt-5 on api.openai.com:443", "grant:ap_1"),
    (MODELS, "denied", "gpt-5", "model gpt-5 on api.openai.com:443", "approval_denied"),
    (MODELS, "timeout", "gpt-5", "model gpt-5 on api.openai.com:443", "approval_timeout"),
    (MODELS, "approved", "gpt-4o-mini", None, "policies/agent.yaml:11"),  # (listed)
    (MODELS, "approved", "gpt-*", None, "model_not_allowed"),  # a glob is never granted
    (POLICY, "approved", "gpt-5", None, "model_not_allowed"),  # models: not askable here
])
def test_a_model_the_allowlist_refuses_may_be_asked_for(
        text: str, state: str, model: str, asked: str | None, outcome: str) -> None:
    approvals = Approvals(state=state)
    gate, _ = _gate(text, approvals)
    ex, got = asyncio.run(_chat(gate, model))
    assert [a.describe() for a, _, _ in approvals.asked] == ([asked] if asked else [])
    if isinstance(got, Refusal):
        assert got.code == outcome
    else:
        assert json.loads(got)["model"] == model
        assert ex.decision.rule is not None and ex.decision.rule.source == outcome


def test_a_model_grant_lets_only_that_model_through() -> None:
    grant = _grant(Asked("model", "api.openai.com", 443, model="gpt-5"))
    approvals = Approvals(state="denied", grants=[grant])
    gate, _ = _gate(MODELS, approvals)
    ex, got = asyncio.run(_chat(gate, "gpt-5"))
    assert isinstance(got, bytes) and ex.decision.rule is not None
    assert ex.decision.rule.source == "grant:gr_1" and approvals.asked == []
    _, other = asyncio.run(_chat(gate, "gpt-5-pro"))
    assert isinstance(other, Refusal) and other.code == "approval_denied"  # (asked: no)


def test_past_the_ask_limit_the_policys_refusal_stands() -> None:
    """A sandbox with too many asks waiting is refused as without ask mode, and told why."""
    from gateway.core.approvals import AskLimit

    class Full(Approvals):
        async def ask(self, identity: Identity, asked: Asked, reason: str, spec: Ask, *,
                      request: Request, model: str | None = None) -> Approval | Grant:
            raise AskLimit("sandbox sandbox-1 already has 16 asks waiting for an answer")

    gate, lines = _gate(POLICY, Full())
    try:
        asyncio.run(_connect(gate, "new.test"))
        raise AssertionError("not refused")
    except Refused as refused:
        assert refused.refusal.code == "policy_denied"
        assert "not asked: sandbox sandbox-1 already has 16 asks" in refused.refusal.reason
    assert lines[-1]["error"] == "policy_denied"


def test_a_grant_written_while_the_request_is_held_lets_it_through() -> None:
    """The port may answer with a grant another ask made meanwhile (on any process): the
    held request goes as that grant decides."""
    approvals = Approvals(state="timeout", written=_grant(HOST))
    gate, _ = _gate(POLICY, approvals)
    _, tunnel = asyncio.run(_connect(gate, "new.test"))
    assert tunnel.decision.rule is not None and tunnel.decision.rule.source == "grant:gr_1"
    assert [a for a, _, _ in approvals.asked] == [HOST]


# (policy, host, the grant the sandbox holds): the DNS resolver answers the name exactly
# when the proxy lets a CONNECT to it through (the same decision, grants included).
DNS_ROWS = [
    (POLICY, "new.test", _grant(HOST)),
    (POLICY, "new.test", None),
    (POLICY, "new.test", _grant(HOST, sandbox="sandbox-2")),
    (NARROW, "new.test", _grant(HOST)),  # (hosts not askable: a grant does not decide)
    (POLICY, "denied.test", _grant(Asked("host", "denied.test", 443))),  # a deny rule
    (POLICY, "denied.test", None),
    (POLICY, "allowed.test", None),
    (POLICY, "asks.test", None),  # a rule with ask: answered, the CONNECT is held
]


@pytest.mark.parametrize(("text", "host", "grant"), DNS_ROWS,
                         ids=["granted", "not granted", "another sandbox's", "not askable",
                              "a deny rule with a grant", "a deny rule", "a rule",
                              "a rule that asks"])
def test_the_dns_resolver_decides_as_the_proxy_does(text: str, host: str,
                                                    grant: Grant | None) -> None:
    from gateway.core.evaluate import name_allowed

    approvals = Approvals(state="denied", grants=[grant] if grant else [])
    gate, _ = _gate(text, approvals)
    policy = load_policy_texts({"policies/agent.yaml": text}).get("agent")
    assert policy is not None
    decision, port = name_allowed(policy, host, lambda request: approvals.grant_for(
        "sandbox-1", "agent", request))
    try:
        _, tunnel = asyncio.run(_connect(gate, host))
        proxy = "allow"
        rule = tunnel.decision.rule
    except Refused as refused:
        proxy, rule = refused.refusal.code, None
    resolver = "allow" if decision.allowed else "policy_denied"
    if host == "asks.test":  # (asked, and here declined: the name still resolves)
        assert (resolver, proxy) == ("allow", "approval_denied")
        return
    assert resolver == ("allow" if proxy == "allow" else "policy_denied"), (resolver, proxy)
    if rule is not None and decision.rule is not None:
        assert decision.rule.source == rule.source and port == 443
