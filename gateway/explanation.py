"""``explain`` with the destination check: the whole answer the gateway would give.

The policy decides first (pure). Only when it allows (or reports) does the gateway
resolve the host and check the address; so does this: a denied host is never
resolved. The check is ``DestinationGuard.check``, the same call the proxy makes,
built from the same config keys (``network.allow_cidrs``, ``deny_cidrs``,
``resolve``, the listen addresses). A refused destination turns the answer into
``deny`` with its code (``forbidden_destination``, ``unresolvable``,
``bad_destination``) and reason, even under ``mode: report``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.config import Config, HostPort
from gateway.core.addresses import AddressPolicy
from gateway.net.resolver import (
    DestinationGuard,
    DestinationRefused,
    Resolver,
    local_interface_addresses,
    parse_overrides,
)
from gateway.policy import Decision, PolicySet, decide, request_for

__all__ = ["DestinationResult", "Explanation", "explain_request", "guard_from_config"]

POLICY_DENIED = "policy_denied"


@dataclass(frozen=True, slots=True)
class DestinationResult:
    """The destination check: the address the gateway would dial, or why it would not.

    ``address_class`` is the classification code of that address (``allow_default``
    for a public one, ``allow_user_configured`` for ``allow_cidrs``/``network.resolve``,
    ``deny_private_range``, ``deny_not_global_unicast``, ...).
    """

    allowed: bool
    code: str | None
    reason: str
    address: str | None = None
    address_class: str | None = None
    trusted: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"allowed": self.allowed, "error": self.code, "reason": self.reason,
                "address": self.address, "class": self.address_class,
                "trusted": self.trusted}


@dataclass(frozen=True, slots=True)
class Explanation:
    """The policy decision and, when it allows, the destination check."""

    decision: Decision
    destination: DestinationResult | None
    refused: tuple[str, str] | None = None  # (code, reason): refused after the policy

    @property
    def result(self) -> str:
        if self.refused is not None or (self.destination is not None
                                        and not self.destination.allowed):
            return "deny"
        return self.decision.result

    @property
    def error(self) -> str | None:
        if self.refused is not None:
            return self.refused[0]
        if self.destination is not None and not self.destination.allowed:
            return self.destination.code
        return POLICY_DENIED if self.decision.result == "deny" else None

    @property
    def reason(self) -> str:
        if self.refused is not None:
            return self.refused[1]
        if self.destination is not None and not self.destination.allowed:
            return self.destination.reason
        return self.decision.reason


def _pairs(*listeners: HostPort | None) -> list[tuple[str, int]]:
    return [(hp.host, hp.port) for hp in listeners if hp is not None]


def guard_from_config(cfg: Config, resolver: Resolver | None = None) -> DestinationGuard:
    """The DestinationGuard the gateway builds from ``cfg`` (system resolver by default).

    Raises ValueError (DestinationError) for a bad ``network`` value.
    """
    listen = cfg.listen
    policy = AddressPolicy(
        allow_cidrs=cfg.network.allow_cidrs, deny_cidrs=cfg.network.deny_cidrs,
        own_addresses=_pairs(listen.proxy, listen.admin, listen.transparent),
        local_addresses=local_interface_addresses(),
    )
    return DestinationGuard(policy, resolver, overrides=parse_overrides(cfg.network.resolve))


async def check_destination(guard: DestinationGuard, host: str, port: int) -> DestinationResult:
    """Resolve and classify ``host:port`` as the proxy would before dialling."""
    try:
        pinned = await guard.check(host, port)
    except DestinationRefused as refused:
        verdict = refused.verdict
        return DestinationResult(False, refused.code, refused.reason,
                                 address_class=verdict.code if verdict else None)
    ip, dial_port = pinned.address
    if pinned.trusted:
        verdict = guard.policy.classify_trusted(ip, dial_port)
    else:
        verdict = guard.policy.classify(ip, dial_port)
    where = f"{ip} port {dial_port}"
    return DestinationResult(True, None, f"{host} -> {where}: {verdict.reason}", where,
                             verdict.code, pinned.trusted)


async def explain_request(policy_set: PolicySet, policy_name: str, method: str, url: str,
                          guard: DestinationGuard | None) -> Explanation:
    """The policy decision for ``method url`` plus, with a guard, the destination check.

    Raises ValueError for an unknown policy or an unusable URL (like ``explain``).
    """
    policy = policy_set.get(policy_name)
    if policy is None:
        known = ", ".join(sorted(policy_set.policies)) or "none"
        raise ValueError(f"unknown policy {policy_name!r} (known: {known[:200]})")
    request = request_for(method, url)
    decision = decide(policy, request)
    if decision.result != "deny" and decision.credential and request.scheme != "https":
        # The gateway puts a key only into TLS (gateway/core/credentials.py).
        return Explanation(decision, None, ("credential_requires_tls", (
            f"credential {decision.credential!r} is injected only over https: this "
            "request would be refused")))
    if guard is None or decision.result == "deny":
        return Explanation(decision, None)
    return Explanation(decision, await check_destination(guard, request.host, request.port))
