"""Stage 1 with ask mode: the policy's decision (`core/evaluate.route`), and where the
policy lets a person decide (`with_grants`), a grant that covers the request, or a
person asked while the request waits (`Approvals`, the ask-mode port).

A request is never held for a person when the leak checks would refuse it once approved
(a key or token in its head, to a host no credential binds it to) or when its
destination is refused: those refusals stand, whoever answers.
"""

from __future__ import annotations

import time

from gateway.core import approvals
from gateway.core.client import Client
from gateway.core.evaluate import Routed, granted, route, with_grants
from gateway.core.identity import Identity
from gateway.core.messages import RequestHead
from gateway.core.policy import Request
from gateway.core.policy.ask_rule import Ask
from gateway.core.refusal import Refusal
from gateway.pipeline.exchange import Exchange, leak_refusal
from gateway.pipeline.parts import Parts

__all__ = ["Asking"]


class Asking:
    """Decides stage 1 for tunnels and requests, asking a person where the policy says
    one may decide; and asks for a model a rule's allowlist refuses."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts

    async def decide(self, client: Client, identity: Identity, request: Request,
                     head: RequestHead | None = None) -> Routed:
        """Stage 1, and ask mode where the policy lets a person decide: a grant that
        covers the request allows it; else an askable refusal (the policy's `ask:`,
        never a deny rule, a credential's binding, a destination the guard refuses or a
        `head` carrying a key or token to the host) or a rule with `ask:` is held until
        a person answers (raises the refusal)."""
        parts = self.parts
        policy = parts.policy(identity)
        start = time.perf_counter()
        routed = route(parts.policies().credentials, policy, request)
        parts.telemetry.observe("decision_seconds", time.perf_counter() - start)
        asks = parts.approvals
        if asks is None:
            if routed.refusal is not None:
                raise routed.refusal
            return routed
        rule = routed.decision.rule
        routed, spec = with_grants(policy, routed, request, lambda asked: asks.grant_for(
            identity.sandbox, identity.policy, asked))
        if spec is None:
            if routed.refusal is not None:
                raise routed.refusal
            return routed
        assert routed.refusal is None or routed.refusal.code == "policy_denied"
        await parts.destination(client, request.host, request.port)  # (never asked: refused)
        if head is not None and routed.credential is None:
            # (nor what the leak checks would refuse once approved; a rule's own
            # credential is swapped, and its head scanned, once it is)
            found = parts.markers.scan_for(request.host, client.token).head(
                head.method, request.path or "/", head.headers.fields)
            if found is not None:
                parts.telemetry.count("exfiltration_blocked", found)
                raise leak_refusal(found, request.host)
        asked = approvals.asked_for(request, host_known=rule is not None and (
            routed.refusal is not None or rule.methods is not None or rule.paths is not None))
        reason = routed.refusal.reason if routed.refusal is not None else \
            f"rule {rule.source if rule else ''} asks before it allows"
        try:
            ended = await asks.ask(identity, asked, reason, spec, request=request)
        except approvals.AskLimit as limit:
            raise _not_asked(routed.refusal or Refusal("policy_denied", reason, rule.source
                                                       if rule else None), limit) from None
        if isinstance(ended, approvals.Grant):  # (written meanwhile, for something else)
            return granted(routed, ended.source, ended.describe(), request)
        if ended.state == "approved":
            return granted(routed, f"grant:{ended.grant or ended.id}",
                           f"approved by {ended.by} ({ended.scope})", request)
        raise _unapproved(ended, spec)

    async def ask_model(self, ex: Exchange, spec: Ask, model: str, refusal: Refusal) -> None:
        """Ask mode for a model the rule's allowlist refuses (`Exchange.request_decided`):
        a grant of it, or a person's yes, lets the exchange go on; else raises."""
        asks = self.parts.approvals
        assert asks is not None
        tgt, identity = ex.target, ex.identity
        request = Request(ex.head.method, tgt.scheme, tgt.host, tgt.port, tgt.path)
        grant = asks.grant_for(identity.sandbox, identity.policy, request, model)
        if grant is not None:
            ex.granted(grant.source, grant.describe())
            return
        asked = approvals.Asked("model", tgt.host, tgt.port, model=model)
        try:
            ended = await asks.ask(identity, asked, refusal.reason, spec, request=request,
                                   model=model)
        except approvals.AskLimit as limit:
            raise _not_asked(refusal, limit) from None
        if isinstance(ended, approvals.Grant):
            ex.granted(ended.source, ended.describe())
            return
        if ended.state != "approved":
            raise _unapproved(ended, spec)
        ex.granted(f"grant:{ended.grant or ended.id}", f"approved by {ended.by} "
                   f"({ended.scope})")

    def grant_gone(self, client: Client) -> bool:
        """The client's tunnel was opened by a grant that has been revoked or expired."""
        tunnel = client.tunnel
        asks = self.parts.approvals
        if tunnel is None or asks is None or tunnel.decision.rule is None:
            return False
        source = tunnel.decision.rule.source
        return source.startswith("grant:gr_") and not asks.active(source[6:])


def _not_asked(refusal: Refusal, limit: approvals.AskLimit) -> Refusal:
    """`refusal`, as it stands when the sandbox has too many asks waiting."""
    return Refusal(refusal.code, f"{refusal.reason}; not asked: {limit}", refusal.rule)


def _unapproved(ended: approvals.Approval, spec: Ask) -> Refusal:
    """The refusal of a request a person declined, or no one answered."""
    source, asked = f"approval:{ended.id}", ended.asked.describe()
    if ended.state == "denied":
        note = f": {ended.note}" if ended.note else ""
        return Refusal("approval_denied", f"a person ({ended.by}) declined {asked} in "
                       f"approval {ended.id}{note}; do not retry it - ask them, or change "
                       "the policy", source)
    return Refusal("approval_timeout", f"no one answered approval {ended.id} for {asked} "
                   f"within {spec.timeout:g}s; it may be asked again later, or allowed by "
                   "a policy change", source)
