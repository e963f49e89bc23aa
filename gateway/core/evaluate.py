"""What the gateway would answer a request, from the decision code the proxy runs (pure).

``evaluate`` composes, in the proxy's order, the decisions that do not depend on the
bytes a sandbox sends or on recorded usage: the policy (``decide``), the credential's
static checks (``credentials.static_refusal``: TLS, binding) and the metering step
(``Metering.admit`` over empty counters: model allowlists, what cannot be metered on a
rule that must be, a call too large for a budget even when nothing is used yet).
Callers that ask "would this be allowed?" without a connection (``policy test``) call
it, so they cannot drift from what the gateway enforces.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.core import credentials
from gateway.counters import MemoryCounters
from gateway.metering import Exchange, Metering
from gateway.policy import Decision, Policy, PolicySet, Request, decide

__all__ = ["Verdict", "evaluate", "static_metering"]


@dataclass(frozen=True, slots=True)
class Verdict:
    """``result`` allow | deny | report; ``error`` the refusal code a deny carries;
    ``rule`` the deciding rule's ``file:line`` (None: no rule)."""

    result: str
    error: str | None
    rule: str | None
    reason: str
    decision: Decision


def static_metering() -> Metering:
    """A metering step over empty, private counters: its answers depend on the request
    alone (nothing is used yet)."""
    return Metering(MemoryCounters(), stream_usage=True)


def evaluate(policy_set: PolicySet, policy: Policy, request: Request, *,
             body: bytes | None = None, metering: Metering | None = None,
             sandbox: str = "policy-test", now: float = 0.0) -> Verdict:
    """The gateway's answer to ``request`` (``body``: its body, as a sandbox sends it)."""
    decision = decide(policy, request)
    rule = decision.rule
    source = rule.source if rule is not None else None
    if not decision.allowed:
        return Verdict("deny", "policy_denied", source, decision.reason, decision)
    if request.method is None or rule is None or decision.credential is None:
        return Verdict(decision.result, None, source, decision.reason, decision)
    credential = policy_set.credentials.get(decision.credential)
    if credential is None:
        return Verdict("deny", "policy_denied", source, f"credential "
                       f"{decision.credential!r} is not defined", decision)
    refusal = credentials.static_refusal(credential, request.scheme, request.host, source)
    if refusal is not None:
        return Verdict("deny", refusal.code, refusal.rule, refusal.reason, decision)
    step = (metering or static_metering()).admit(
        sandbox=sandbox, policy=policy, rule=rule, preset=credential.preset,
        method=request.method, path=request.path or "/", body=body, now=now)
    if isinstance(step, Exchange):
        return Verdict(decision.result, None, source, decision.reason, decision)
    if policy.mode == "report":  # forwarded, the would-deny recorded
        return Verdict("report", None, step.rule, step.reason, decision)
    return Verdict("deny", step.code, step.rule, step.reason, decision)
