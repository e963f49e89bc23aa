"""``explain``: the decision pipeline's answer with the destination check between its stages.

The policy and the credential's static checks decide first (``core/evaluate.route``,
pure). Only when they allow (or report) does the gateway resolve the host and check
the address; so does this: a denied host is never resolved. The check is
``DestinationGuard.check``, the same call the proxy makes, built from the same config
keys (``network.allow_cidrs``, ``deny_cidrs``, ``resolve``, the listen addresses). A
refused destination turns the answer into ``deny`` with its code
(``forbidden_destination``, ``unresolvable``, ``bad_destination``) and reason, even
under ``mode: report``. Given a body (or a model), the metering step runs last, as in
the proxy once the body is whole: model allowlists, what cannot be metered.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.config import Config, HostPort
from gateway.core.addresses import AddressPolicy
from gateway.core.evaluate import UNSEEN, Unseen, Verdict, askable, meter, request_for, route
from gateway.core.mcp import request_body
from gateway.core.policy import Decision, PolicySet
from gateway.core.policy.ask_rule import Ask
from gateway.net.resolver import (
    DestinationGuard,
    DestinationRefused,
    Resolver,
    local_interface_addresses,
    parse_overrides,
)
from gateway.services.dlp.detectors import for_tools
from gateway.services.metering import Metering, static_metering

__all__ = ["DestinationResult", "Explanation", "explain_body", "explain_request",
           "guard_from_config"]


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
    """The decision pipeline's verdict (``core/evaluate.py``) and, when the policy
    allows and a guard is given, the destination check between its stages."""

    verdict: Verdict
    destination: DestinationResult | None
    ask: Ask | None = None  # ask mode: a person may decide (the proxy asks, not explain)

    @property
    def decision(self) -> Decision:
        return self.verdict.decision

    def _refused(self) -> DestinationResult | None:
        destination = self.destination
        return destination if destination is not None and not destination.allowed else None

    @property
    def result(self) -> str:
        return "deny" if self._refused() is not None else self.verdict.result

    @property
    def error(self) -> str | None:
        refused = self._refused()
        return refused.code if refused is not None else self.verdict.error

    @property
    def reason(self) -> str:
        refused = self._refused()
        return refused.reason if refused is not None else self.verdict.reason

    @property
    def metered(self) -> bool:
        """Whether the metering step ran (it needs the request's body or model)."""
        return self.verdict.metered


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


def explain_body(body: str | None, model: str | None,
                 mcp: str | None = None, mcp_arguments: str | None = None) -> bytes | Unseen:
    """The body ``explain`` decides with: ``body`` as given, ``{"model": model}``, or
    the JSON-RPC of an MCP call (``core/mcp.request_body``); UNSEEN without any (the
    metering and MCP steps are then not run)."""
    if sum(x is not None for x in (body, model, mcp)) > 1:
        raise ValueError("give one of a body, a model or an MCP call")
    if body is not None:
        return body.encode()
    if model is not None:
        return json.dumps({"model": model}).encode()
    if mcp is not None:
        arguments = None
        if mcp_arguments is not None:
            try:
                arguments = json.loads(mcp_arguments)
            except ValueError:
                raise ValueError("--mcp-arguments must be a JSON object") from None
        return request_body(mcp, arguments)
    return UNSEEN


async def explain_request(policy_set: PolicySet, policy_name: str, method: str, url: str,
                          guard: DestinationGuard | None,
                          body: bytes | Unseen | None = UNSEEN,
                          metering: Metering | None = None) -> Explanation:
    """The gateway's answer to ``method url`` (``body``: as sent; UNSEEN: not known) by
    the decision pipeline: stage 1, then with a guard the destination check (only on
    what the policy allows: a denied host is never resolved), then the body stage
    (credential detection where ``dlp:`` applies, the metering step).

    Raises ValueError for an unknown policy or an unusable URL (like ``explain``).
    """
    policy = policy_set.get(policy_name)
    if policy is None:
        known = ", ".join(sorted(policy_set.policies)) or "none"
        raise ValueError(f"unknown policy {policy_name!r} (known: {known[:200]})")
    request = request_for(method, url)
    routed = route(policy_set.credentials, policy, request)
    destination = None
    if guard is not None and routed.refusal is None:
        destination = await check_destination(guard, request.host, request.port)
        if not destination.allowed:
            body = UNSEEN  # refused before the metering step, as the proxy does
    detectors = for_tools() if policy_set.uses_dlp else None  # (dlp:, built once)
    return Explanation(meter(routed, policy, request, body, metering or static_metering(),
                             detectors=detectors),
                       destination,
                       askable(policy, routed, request))
