"""The DNS resolver's pure parts: `answer()` (query, sandbox, policy, lookup -> response and
audit facts), `name_allowed`, the wire helpers, the rate limiter, and
`DestinationGuard.check_all` (which gives `answer` its addresses). Table-driven; no
socket is opened and no name leaves the process (StaticResolver)."""

from __future__ import annotations

import asyncio
import time

import dns.flags
import dns.message
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import pytest

from gateway.core.addresses import AddressPolicy
from gateway.core.approvals import Asked, Grant
from gateway.core.evaluate import name_allowed
from gateway.core.policy import Policy, Request
from gateway.engines.dns.answer import Lookup, Need, answer, failure, formerr, parse
from gateway.engines.dns.limit import RateLimiter
from gateway.net.resolver import DestinationGuard, DestinationRefused, StaticResolver
from gateway.services.policy import load_policy_text
from gateway.services.state.base import SandboxAddress

POLICY = """\
version: v1
name: agent
egress:
  - host: allowed.test
  - host: "*.cdn.test"
  - host: git.test
    ports: [22]
    protocol: tcp
  - host: api.test
    methods: [GET]
    paths: ["/v1/**"]
  - host: alt.test
    ports: [8443]
"""
REPORT = """\
version: v1
name: watch
mode: report
egress:
  - host: allowed.test
"""
SANDBOX = SandboxAddress("sbx-1", "127.0.0.2", "agent")
TTL = 7


def _policy(text: str = POLICY, name: str = "agent") -> Policy:
    policy = load_policy_text(f"{name}.yaml", text).get(name)
    assert policy is not None
    return policy


def _query(name: str, rdtype: str = "A", rdclass: str = "IN") -> dns.message.Message:
    wire = dns.message.make_query(name, rdtype, rdclass).to_wire()
    query = parse(wire)
    assert query is not None
    return query


# ------------------------------------------------------------------------- name_allowed


@pytest.mark.parametrize(
    ("host", "result", "port", "rule_line"),
    [
        ("allowed.test", "allow", 443, 4),
        ("a.cdn.test", "allow", 443, 5),
        ("git.test", "allow", 22, 6),       # only port 22 (raw TCP): still answerable
        ("api.test", "allow", 443, 9),      # an inspected rule counts too
        ("alt.test", "allow", 8443, 12),    # only a non-default port
        ("cdn.test", "deny", 443, None),    # "*." is subdomains only
        ("evil.test", "deny", 443, None),
        ("allowed.test.evil.test", "deny", 443, None),
    ],
)
def test_name_allowed_any_rule_on_any_port(host: str, result: str, port: int,
                                            rule_line: int | None) -> None:
    decision, chosen = name_allowed(_policy(), host)
    assert (decision.result, chosen) == (result, port)
    if rule_line is None:
        assert decision.rule is None
    else:
        assert decision.rule is not None and decision.rule.source == f"agent.yaml:{rule_line}"


def test_name_allowed_report_mode_allows_with_report() -> None:
    decision, _ = name_allowed(_policy(REPORT, "watch"), "evil.test")
    assert decision.result == "report" and decision.allowed
    decision, _ = name_allowed(_policy(REPORT, "watch"), "allowed.test")
    assert decision.result == "allow"


# ------------------------------------------------------------------------------- answer

A4, B4, A6 = "203.0.113.10", "203.0.113.11", "2001:db8::10"
OK = Lookup((A4, A6, B4))


@pytest.mark.parametrize(
    ("case", "name", "rdtype", "sandbox", "lookup", "rcode", "error", "answers"),
    [
        ("allowed A", "allowed.test", "A", SANDBOX, OK, "NOERROR", None, (A4, B4)),
        ("allowed AAAA", "allowed.test", "AAAA", SANDBOX, OK, "NOERROR", None, (A6,)),
        ("no address of that family", "allowed.test", "AAAA", SANDBOX, Lookup((A4,)),
         "NOERROR", None, ()),
        ("case and final dot", "ALLOWED.Test.", "A", SANDBOX, OK, "NOERROR", None, (A4, B4)),
        ("wildcard rule", "x.cdn.test", "A", SANDBOX, OK, "NOERROR", None, (A4, B4)),
        ("denied name", "evil.test", "A", SANDBOX, None, "NXDOMAIN", "policy_denied", ()),
        ("denied, exfiltration-shaped", "mzxw6ytboi.evil.test", "AAAA", SANDBOX, None,
         "NXDOMAIN", "policy_denied", ()),
        ("unknown source", "allowed.test", "A", None, OK, "REFUSED", "unknown_sandbox", ()),
        ("TXT", "allowed.test", "TXT", SANDBOX, OK, "REFUSED", "type_refused", ()),
        ("TXT denied name", "evil.test", "TXT", SANDBOX, OK, "REFUSED", "type_refused", ()),
        ("NULL", "allowed.test", "NULL", SANDBOX, OK, "REFUSED", "type_refused", ()),
        ("ANY", "allowed.test", "ANY", SANDBOX, OK, "REFUSED", "type_refused", ()),
        ("CNAME", "allowed.test", "CNAME", SANDBOX, OK, "REFUSED", "type_refused", ()),
        ("MX", "allowed.test", "MX", SANDBOX, OK, "REFUSED", "type_refused", ()),
        ("SRV", "allowed.test", "SRV", SANDBOX, OK, "REFUSED", "type_refused", ()),
        ("HTTPS", "allowed.test", "HTTPS", SANDBOX, OK, "REFUSED", "type_refused", ()),
        ("forbidden address only", "allowed.test", "A", SANDBOX,
         Lookup(error="forbidden_destination", reason="allowed.test resolves to 10.0.0.1"),
         "REFUSED", "forbidden_destination", ()),
        ("unresolvable", "allowed.test", "A", SANDBOX,
         Lookup(error="unresolvable", reason="could not resolve allowed.test"),
         "SERVFAIL", "unresolvable", ()),
        ("IP literal as a name", "127.0.0.1", "A", SANDBOX, OK, "NXDOMAIN", "bad_name", ()),
        ("not a host name", "a\\000b.test", "A", SANDBOX, OK, "NXDOMAIN", "bad_name", ()),
        ("root", ".", "A", SANDBOX, OK, "NXDOMAIN", "bad_name", ()),
    ],
)
def test_answer_table(case: str, name: str, rdtype: str, sandbox: SandboxAddress | None,
                      lookup: Lookup | None, rcode: str, error: str | None,
                      answers: tuple[str, ...]) -> None:
    query = _query(name, rdtype)
    outcome = answer(query, sandbox, _policy(), None, TTL)
    if outcome.need is not None:  # allowed A/AAAA: resolve, then answer
        assert outcome.response is None
        assert lookup is not None, case
        outcome = answer(query, sandbox, _policy(), lookup, TTL)
    assert outcome.need is None
    assert outcome.rcode == rcode, case
    assert outcome.error == error, case
    assert outcome.answer == answers, case
    assert outcome.decision == ("allow" if error is None else "deny")
    response = outcome.response
    assert response is not None
    assert dns.rcode.to_text(response.rcode()) == rcode
    assert response.id == query.id and response.flags & dns.flags.QR
    assert response.question == query.question  # echoed, case preserved
    got = [rd.address for rrset in response.answer for rd in rrset]
    assert tuple(got) == answers
    assert all(rrset.ttl == TTL for rrset in response.answer)
    assert not response.authority and not response.additional
    # The wire form round-trips through a real parser.
    back = dns.message.from_wire(response.to_wire())
    assert back.rcode() == response.rcode()


def test_a_name_is_resolved_only_after_the_policy_allowed_it() -> None:
    query = _query("allowed.test")
    outcome = answer(query, SANDBOX, _policy(), None, TTL)
    assert outcome.need == Need("allowed.test", 443) and outcome.response is None
    assert outcome.rule == "agent.yaml:4"
    assert answer(_query("git.test"), SANDBOX, _policy(), None, TTL).need == Need("git.test", 22)
    for name, rdtype in (("evil.test", "A"), ("allowed.test", "TXT")):
        assert answer(_query(name, rdtype), SANDBOX, _policy(), None, TTL).need is None
    assert answer(query, None, _policy(), None, TTL).need is None


def test_denied_name_reason_and_audit_facts() -> None:
    outcome = answer(_query("Evil.Test", "AAAA"), SANDBOX, _policy(), None, TTL)
    assert outcome.host == "evil.test" and outcome.qtype == "AAAA"
    assert 'no rule in policy "agent" allows host "evil.test"' in outcome.reason
    assert outcome.rule is None


def test_report_mode_answers_with_decision_report() -> None:
    query = _query("evil.test")
    policy = _policy(REPORT, "watch")
    outcome = answer(query, SandboxAddress("s", "127.0.0.9", "watch"), policy,
                     Lookup((A4,)), TTL)
    assert (outcome.decision, outcome.rcode, outcome.answer) == ("report", "NOERROR", (A4,))


def test_gone_policy_wrong_class_opcode_and_question_count() -> None:
    outcome = answer(_query("allowed.test"), SANDBOX, None, None, TTL)
    assert (outcome.rcode, outcome.error) == ("REFUSED", "unknown_policy")
    outcome = answer(_query("allowed.test", "A", "CH"), SANDBOX, _policy(), OK, TTL)
    assert (outcome.rcode, outcome.error) == ("REFUSED", "class_refused")
    notify = _query("allowed.test")
    notify.set_opcode(dns.opcode.NOTIFY)
    outcome = answer(notify, SANDBOX, _policy(), OK, TTL)
    assert (outcome.rcode, outcome.error) == ("NOTIMP", "not_implemented")
    two = _query("allowed.test")
    two.question.append(_query("alt.test").question[0])
    outcome = answer(parse(two.to_wire()) or two, SANDBOX, _policy(), OK, TTL)
    assert (outcome.rcode, outcome.error) == ("FORMERR", "malformed")


def test_failure_builds_refusals_outside_answer() -> None:
    query = _query("allowed.test")
    outcome = failure(query, dns.rcode.REFUSED, "rate limit", "rate_limited")
    assert outcome.response is not None and outcome.response.rcode() == dns.rcode.REFUSED
    assert (outcome.host, outcome.qtype, outcome.decision) == ("allowed.test", "A", "deny")


# ------------------------------------------------------------------------ wire helpers


def test_parse_refuses_garbage_and_responses() -> None:
    assert parse(b"") is None
    assert parse(b"\x00" * 5) is None
    assert parse(b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07trunc") is None
    response = dns.message.make_response(dns.message.make_query("a.test", "A"))
    assert parse(response.to_wire()) is None  # never answer a response (reflection)
    query = parse(dns.message.make_query("a.test", "A", use_edns=0).to_wire())
    assert query is not None and str(query.question[0].name) == "a.test."


def test_formerr_keeps_the_id_and_refuses_responses() -> None:
    wire = b"\xab\xcd\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07trunc"
    reply = formerr(wire)
    assert reply is not None
    parsed = dns.message.from_wire(reply)
    assert parsed.id == 0xABCD and parsed.rcode() == dns.rcode.FORMERR
    assert parsed.flags & dns.flags.QR and parsed.flags & dns.flags.RD
    assert formerr(b"\x00" * 11) is None
    assert formerr(b"\xab\xcd\x81\x80" + b"\x00" * 8) is None


# --------------------------------------------------------------------------- rate limit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rate_limiter_buckets_are_per_sandbox() -> None:
    clock = Clock()
    limiter = RateLimiter(rate=10, burst=5, clock=clock)
    assert [limiter.allow("a") for _ in range(7)] == [True] * 5 + [False] * 2
    assert limiter.allow("b")  # another sandbox is untouched
    clock.now += 0.11  # one token back
    assert limiter.allow("a") and not limiter.allow("a")
    clock.now += 10  # refilled to the burst, not beyond
    assert [limiter.allow("a") for _ in range(6)] == [True] * 5 + [False]


def test_rate_limiter_audit_lines_once_a_second() -> None:
    clock = Clock()
    limiter = RateLimiter(rate=1, burst=1, clock=clock)
    assert limiter.allow("a")
    counts, refused = [], 0
    for _ in range(50):  # 20 queries/s for 2.5 s against 1/s
        if not limiter.allow("a"):
            refused += 1
            counts.append(limiter.line_due("a"))
        clock.now += 0.05
    lines = [c for c in counts if c is not None]
    assert refused >= 45
    assert lines[0] == 1 and len(lines) == 3  # at 0 s, 1 s and 2 s
    assert sum(lines) <= refused and lines[1] >= 15  # each line counts what it stands for
    assert limiter.line_due("unknown-key") is None


def test_rate_limiter_stays_bounded() -> None:
    clock = Clock()
    limiter = RateLimiter(rate=1, burst=2, clock=clock, max_keys=10)
    for i in range(100):
        limiter.allow(f"k{i}")
        clock.now += 0.001
    assert len(limiter._buckets) <= 10
    clock.now += 10
    assert limiter.allow("k99")


# --------------------------------------------------------------- check_all (the lookup)


def _guard(mapping: dict[str, list[str]], overrides: dict[str, tuple[str, int]] | None = None,
           allow: tuple[str, ...] = ("203.0.113.0/24", "2001:db8::/32")) -> DestinationGuard:
    policy = AddressPolicy(allow_cidrs=allow, own_addresses=[("203.0.113.99", 443)])
    return DestinationGuard(policy, StaticResolver(mapping), overrides)


@pytest.mark.parametrize(
    ("ips", "expected"),
    [
        ([A4, B4], [A4, B4]),
        ([A4, "10.0.0.1", A6], [A4, A6]),                     # forbidden ones dropped
        (["10.0.0.1", A4, A4], [A4]),                          # de-duplicated
        (["2001:DB8:0::10"], [A6]),                            # canonical text
    ],
)
def test_check_all_keeps_only_allowed_addresses(ips: list[str], expected: list[str]) -> None:
    pins = asyncio.run(_guard({"n.test": ips}).check_all("n.test", 443))
    assert [p.ip for p in pins] == expected


@pytest.mark.parametrize(
    ("ips", "code"),
    [
        (["10.0.0.1", "169.254.169.254"], "forbidden_destination"),
        (["127.0.0.1"], "forbidden_destination"),
        (["::ffff:10.0.0.1"], "forbidden_destination"),
        (["203.0.113.99"], "forbidden_destination"),          # the gateway's own listener
        ([], "unresolvable"),
    ],
)
def test_check_all_refuses_like_check(ips: list[str], code: str) -> None:
    guard = _guard({"n.test": ips})
    for call in (guard.check_all, guard.check):
        with pytest.raises(DestinationRefused) as info:
            asyncio.run(call("n.test", 443))
        assert info.value.code == code


def test_check_all_honours_overrides() -> None:
    guard = _guard({}, overrides={"o.test": ("127.0.0.1", 8443)})
    pins = asyncio.run(guard.check_all("o.test", 443))
    assert [(p.ip, p.trusted) for p in pins] == [("127.0.0.1", True)]
    with pytest.raises(DestinationRefused) as info:
        asyncio.run(guard.check_all("missing.test", 443))
    assert info.value.code == "unresolvable"


def test_a_name_a_person_granted_the_sandbox_resolves() -> None:
    """Ask mode: a grant covering a CONNECT to the name (this sandbox's, or its
    policy's) makes it resolve, the grant named as the rule, where the proxy would let
    the grant decide: not over a deny rule, nor in a policy whose `ask:` does not let a
    person decide hosts; other names stay refused."""
    asking = POLICY.replace("egress:\n", "ask: {hosts: true}\negress:\n  - host: denied.test\n"
                            "    action: deny\n")
    now = time.time()

    def grants(request: Request) -> Grant | None:
        if request.host not in ("new.test", "denied.test") or request.port != 443:
            return None
        return Grant(id="gr_1", approval="ap_1", scope="sandbox", policy="agent",
                     sandbox="sbx-1", asked=Asked("host", request.host, 443), by="alice",
                     note=None, created=now, expires=now + 60)

    policy = _policy(asking)
    outcome = answer(_query("new.test"), SANDBOX, policy, None, TTL, grants)
    assert outcome.need == Need("new.test", 443) and outcome.rule == "grant:gr_1"
    assert answer(_query("evil.test"), SANDBOX, policy, None, TTL, grants).need is None
    refused = answer(_query("denied.test"), SANDBOX, policy, None, TTL, grants)
    assert (refused.need, refused.rcode, refused.error) == (None, "NXDOMAIN", "policy_denied")
    # (without ask: hosts, a grant decides nothing; what the policy allows is its own)
    assert answer(_query("new.test"), SANDBOX, _policy(), None, TTL, grants).need is None
    assert answer(_query("allowed.test"), SANDBOX, policy, None, TTL,
                  grants).rule == "agent.yaml:7"
