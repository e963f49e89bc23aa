"""The decision pipeline: what the gateway answers a request, in one place (pure).

Every caller that decides a request runs these stages, in this order, and no copy:

1. ``route`` — the policy (``decide``), then the credential's static checks: a
   credential the rule names must be defined, bound to the host and used over TLS
   (``credentials.static_refusal``). The proxy calls it for every tunnel and request
   (``pipeline/``); ``policy explain``, ``policy test``, ``policy diff --replay``
   and the DNS resolver (``name_allowed``) call it too. ``askable`` says whether a
   person may decide what it refuses (ask mode), for the proxy and ``explain`` alike;
   ``with_grants`` lets a grant decide there, for the proxy and the DNS resolver alike.
2. (the destination check: I/O, ``DestinationGuard.check``; the proxy and ``explain
   --resolve`` run it between 1 and 3, on what stage 1 allowed — a denied host is
   never resolved)
3. ``meter`` — the body stage (``core/body_stage.py``, the same functions the proxy's
   exchange calls as the head and body arrive): an ``mcp:`` rule's method and
   JSON-RPC calls, with ``detectors`` outbound credential detection (``dlp:``, the
   ``Detectors`` port: the request line and a body held whole; the proxy also reads
   headers and streamed bodies), then the metering step (the ``Metering`` port;
   callers without traffic give ``services/metering``'s ``static_metering``, over
   counters that stay empty, the proxy its live one): model allowlists, what cannot be
   metered on a rule that must be, a provider-minted secret, a call too large for a
   budget. Under ``mode: report`` a refusal is ``report`` with its own reason and rule,
   for the proxy's audit line and these verdicts alike.

``evaluate`` is stages 1 and 3 for callers that have no connection. What depends on
the bytes a sandbox sends (tokens, leaks, heads) or on recorded usage is decided by
the proxy alone; a request is ``allow`` here when nothing above refuses it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Final

from gateway.core import credentials
from gateway.core.approvals import Grant
from gateway.core.body_stage import Stage, dlp_stage, mcp_stage, metering_stage
from gateway.core.policy import Credential, Decision, Policy, PolicySet, Request, Rule, decide
from gateway.core.policy.ask_rule import Ask
from gateway.core.ports import Detectors, Metering
from gateway.core.refusal import Refusal
from gateway.core.target import url_target

__all__ = ["UNSEEN", "Grants", "Routed", "Unseen", "Verdict", "askable", "evaluate",
           "granted", "meter", "name_allowed", "request_for", "route", "with_grants"]


class Unseen:
    """The type of ``UNSEEN``: a caller that has no body (and does not ask)."""

    def __repr__(self) -> str:
        return "UNSEEN"


UNSEEN: Final = Unseen()  # `body=UNSEEN`: the metering step is not run (see `evaluate`)


@dataclass(frozen=True, slots=True)
class Routed:
    """Stage 1: the policy's decision, the credential it injects (defined, bound, over
    TLS) and the refusal (None: allowed so far)."""

    decision: Decision
    credential: Credential | None
    refusal: Refusal | None


@dataclass(frozen=True, slots=True)
class Verdict:
    """``result`` allow | deny | report; ``error`` the refusal code a deny carries;
    ``rule`` the deciding rule's ``file:line`` (None: no rule); ``metered`` whether the
    metering step ran (it needs a body, or ``body=None`` for one not held)."""

    result: str
    error: str | None
    rule: str | None
    reason: str
    decision: Decision
    metered: bool = True


def _source(decision: Decision) -> str | None:
    return decision.rule.source if decision.rule is not None else None


def route(credentials_by_name: Mapping[str, Credential], policy: Policy,
          request: Request) -> Routed:
    """Stage 1 for ``request`` (``method`` None: a tunnel, decided on host and port)."""
    decision = decide(policy, request)
    if not decision.allowed:
        return Routed(decision, None, Refusal("policy_denied", decision.reason,
                                              _source(decision)))
    name = decision.credential
    if request.method is None or name is None:
        return Routed(decision, None, None)
    rule = _source(decision)
    credential = credentials_by_name.get(name)
    if credential is None:
        return Routed(decision, None, Refusal("policy_denied", f"credential {name!r} is not "
                                              "defined; fix the policy", rule))
    return Routed(decision, credential, credentials.static_refusal(
        credential, request.scheme, request.host, rule))


def askable(policy: Policy, routed: Routed, request: Request) -> Ask | None:
    """The `ask:` that lets a person decide this request, or None: a rule's own `ask`
    (what it allows waits for a person), or the policy's for a refusal of its rules -
    `hosts` for a host no rule names, `requests` for a method or path on one that
    does. Never a deny rule's refusal or a credential's (those are not the policy
    failing to foresee something)."""
    decision, rule = routed.decision, routed.decision.rule
    if routed.refusal is None:  # (a rule that decides per request asks per request)
        if rule is None or rule.ask is None or (request.method is None and decision.inspect):
            return None
        return rule.ask
    if decision.allowed or routed.refusal.code != "policy_denied" or policy.ask is None:
        return None
    if rule is not None and rule.denies:
        return None
    if rule is None:
        return policy.ask if policy.ask.hosts else None
    return policy.ask if policy.ask.requests and request.method is not None else None


Grants = Callable[[Request], Grant | None]  # the grant covering a request (ask mode's view)


def with_grants(policy: Policy, routed: Routed, request: Request,
                grants: Grants | None) -> tuple[Routed, Ask | None]:
    """Ask mode on stage 1: where a person may decide (`askable`), a grant covering the
    request decides as a rule would (`granted`); otherwise the `ask:` that would hold it
    for a person, or None where `routed` stands as the policy decided it. The proxy asks
    what is left to ask; the DNS resolver never asks (a name is answered only where
    the decision allows)."""
    spec = askable(policy, routed, request)
    if spec is None:
        return routed, None
    grant = grants(request) if grants is not None else None
    if grant is not None:
        return granted(routed, grant.source, grant.describe(), request), None
    return routed, spec


def granted(routed: Routed, source: str, reason: str, request: Request) -> Routed:
    """The decision a grant (or an approval) makes: the matching rule's where one asked
    (its credential and inspection kept), else a rule standing for the grant alone."""
    rule = routed.decision.rule
    if routed.refusal is None and rule is not None:
        return Routed(Decision("allow", reason, replace(rule, source=source, ask=None),
                               routed.decision.inspect, routed.decision.credential),
                      routed.credential, None)
    stand_in = Rule(host=request.host, source=source, ports=(request.port,))
    return Routed(Decision("allow", reason, stand_in), None, None)


def request_for(method: str, url: str) -> Request:
    """The pipeline's input for ``method url`` as a client would send it (the target
    read by ``core/target.url_target``); ``CONNECT`` asks the tunnel-level decision for
    the URL's host and port (``tcp://host:port``: a raw TCP tunnel). Raises ValueError
    for a URL the gateway would not accept."""
    method = method.upper()
    tunnel = method == "CONNECT"
    try:
        tgt = url_target(url, tunnel=tunnel)
    except Refusal as refusal:
        raise ValueError(refusal.reason) from None
    if tunnel:
        return Request(None, "tcp" if tgt.scheme == "tcp" else "https", tgt.host, tgt.port,
                       None)
    return Request(method, tgt.scheme, tgt.host, tgt.port, tgt.path)


def meter(routed: Routed, policy: Policy, request: Request,
          body: bytes | Unseen | None = UNSEEN, metering: Metering | None = None, *,
          sandbox: str = "policy-test", now: float = 0.0,
          detectors: Detectors | None = None) -> Verdict:
    """Stage 3 on what stage 1 allowed: ``body`` as a sandbox sends it (None: not held,
    as the proxy sees a streamed or oversized body; UNSEEN: a caller that knows no body,
    so a credential call's verdict says ``metered`` False, as it does without a
    ``metering`` step to ask)."""
    decision, rule = routed.decision, routed.decision.rule
    refusal = routed.refusal
    if refusal is not None:
        return Verdict("deny", refusal.code, refusal.rule, refusal.reason, decision)
    source = _source(decision)
    if rule is not None and rule.mcp is not None and request.method is not None:
        stage = mcp_stage(rule.mcp, policy.mode, request.method, body, frozenset(), source)
        if stage.refusal is not None:
            return _stage_verdict(stage, stage.refusal, decision)
    if detectors is not None and rule is not None and request.method is not None:
        stage = dlp_stage(detectors, policy, rule, host=request.host, method=request.method,
                          target=request.path or "/", body=body)
        if stage.refusal is not None:
            return _stage_verdict(stage, stage.refusal, decision)
    if routed.credential is None or rule is None or request.method is None:
        return Verdict(decision.result, None, source, decision.reason, decision)
    if isinstance(body, Unseen) or metering is None:
        return Verdict(decision.result, None, source, decision.reason, decision,
                       metered=False)
    stage = metering_stage(metering, policy, rule, sandbox=sandbox,
                           preset=routed.credential.preset, method=request.method,
                           path=request.path or "/", body=body, now=now)
    if stage.refusal is None:
        return Verdict(decision.result, None, source, decision.reason, decision)
    return _stage_verdict(stage, stage.refusal, decision)


def _stage_verdict(stage: Stage, refusal: Refusal, decision: Decision) -> Verdict:
    """A body-stage refusal as a verdict: ``deny`` with its code, or under ``mode:
    report`` ``report`` with the same reason and rule (forwarded, recorded)."""
    if stage.report:
        return Verdict("report", None, refusal.rule, refusal.reason, decision)
    return Verdict("deny", refusal.code, refusal.rule, refusal.reason, decision)


def evaluate(policy_set: PolicySet, policy: Policy, request: Request, *,
             body: bytes | Unseen | None = UNSEEN, metering: Metering | None = None,
             sandbox: str = "policy-test", now: float = 0.0,
             detectors: Detectors | None = None) -> Verdict:
    """The gateway's answer to ``request`` from stages 1 and 3 (see `meter` for
    ``body``; ``detectors``: outbound credential detection, where ``dlp:`` applies)."""
    return meter(route(policy_set.credentials, policy, request), policy, request, body,
                 metering, sandbox=sandbox, now=now, detectors=detectors)


def name_allowed(policy: Policy, host: str, grants: Grants | None = None
                 ) -> tuple[Decision, int]:
    """Whether ``policy`` lets ``host`` be reached, and on which port (the DNS
    resolver's question): tunnel-level decisions for 443, then 80, then every port a
    rule matching the host lists, each as the proxy takes it at a CONNECT, ask mode's
    ``grants`` included (`with_grants`: only where a person may decide, never over a
    deny rule); the first ``allow`` wins, else the decision for 443 (a deny, or
    ``report`` under ``mode: report``)."""
    def tunnel(port: int) -> Decision:  # (no credentials at tunnel level)
        request = Request(None, "https", host, port, None)
        return with_grants(policy, route({}, policy, request), request, grants)[0].decision

    first = tunnel(443)
    if first.result == "allow":
        return first, 443
    ports = dict.fromkeys((80, *(p for entry in policy.matcher.candidates(host)
                                 for p in sorted(entry.rule.ports or ()))))
    for port in ports:
        if port != 443 and (decision := tunnel(port)).result == "allow":
            return decision, port
    return first, 443
