"""What the pipeline's units share: the ports the gateway wired in (`core/ports.py`), the
state kept per process (connections, identities, leak markers, MCP sessions, the audit
trail), and the few checks every unit makes the same way (health, the identity's policy,
a destination checked and pinned once per connection, the fail-closed boundary)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.core import mcp
from gateway.core.addresses import Pinned
from gateway.core.client import Client, Refused
from gateway.core.identity import Identity
from gateway.core.mcp_pins import ToolPins
from gateway.core.policy import Policy, PolicySet
from gateway.core.policy.hosts import HostPattern
from gateway.core.ports import (
    NO_MINTED_SECRETS,
    SILENT,
    Approvals,
    AuditHealth,
    Detectors,
    Guard,
    McpTokens,
    Metering,
    MintedSecrets,
    Secrets,
    Signers,
    StateHealth,
    Telemetry,
    Tokens,
)
from gateway.core.refusal import GATEWAY_ERROR, Refusal
from gateway.core.trail import Trail
from gateway.pipeline.connections import Connections
from gateway.pipeline.identify import Identifier
from gateway.pipeline.markers import Markers
from gateway.pipeline.unpacking import UNPACKED_EXCESS, UNPACKED_EXCESS_RATE, UnpackBudgets

log = logging.getLogger("sandbox_gateway")

__all__ = ["Parts"]

_AUDIT_UNAVAILABLE = ("the gateway cannot write its audit trail now and refuses new "
                      "requests until it can (audit.on_failure: refuse); retry later")
_STATE_UNAVAILABLE = ("the gateway cannot reach its state store now (revocations, budgets) "
                      "and refuses new requests until it can (state.unavailable: refuse); "
                      "retry later")
_PINS_KEPT = 64  # destinations pinned per connection before the cache starts over


async def _no_resolver(host: str, port: int) -> list[str]:
    raise OSError(f"no resolver for {host}")


@dataclass(eq=False)
class Parts:
    """One per gateway process, shared by its units (see the module docstring). The
    ports that may be switched on later (`metering`, `approvals`, `pins`, health) are
    plain attributes: a unit reads them when it decides."""

    tokens: Tokens
    policies: Callable[[], PolicySet]
    guard: Guard
    secrets: Secrets
    trail: Trail
    connections: Connections
    identities: Identifier
    markers: Markers
    telemetry: Telemetry = SILENT
    resolve: Callable[[str, int], Awaitable[list[str]]] = _no_resolver
    metering: Metering | None = None
    signers: Signers | None = None
    ephemeral: MintedSecrets = NO_MINTED_SECRETS
    audit_health: AuditHealth | None = None
    state_health: StateHealth | None = None
    approvals: Approvals | None = None
    pins: ToolPins | None = None  # MCP tool descriptions pinned in the state store
    detectors: Detectors | None = None  # outbound credential detection (policies' dlp:)
    # hosts whose requests carry the gateway's span as their traceparent (telemetry.propagate)
    propagate: tuple[HostPattern, ...] = ()
    mcp_tokens: McpTokens | None = None  # MCP servers' OAuth tokens (rules with mcp.oauth)
    refusals_inside_tls: bool = False
    mcp_sessions: mcp.Sessions = field(default_factory=mcp.Sessions)
    # what each sandbox's compressed data may unpack to past ordinary archives' (`limits:`)
    unpacking: UnpackBudgets = field(default_factory=lambda: UnpackBudgets(
        UNPACKED_EXCESS, UNPACKED_EXCESS_RATE))

    def check_health(self) -> None:
        """New exchanges are refused while their audit lines cannot be written (the
        sink's `refusing`, `audit.on_failure: refuse`), and while the state store is
        away if the operator chose so (`state.unavailable: refuse`). Raises Refusal."""
        health = self.audit_health
        if health is not None and health.refusing is not None:
            raise Refusal("audit_unavailable", _AUDIT_UNAVAILABLE, retry_after=5)
        state = self.state_health
        if state is not None and state.refusing is not None:
            raise Refusal("state_unavailable", _STATE_UNAVAILABLE, retry_after=5)

    def policy(self, identity: Identity) -> Policy:
        """The identity's policy as loaded now (raises Refusal if it is gone)."""
        found = self.policies().get(identity.policy)
        if found is None:
            raise Refusal("policy_denied", f"policy {identity.policy!r} is not loaded any "
                          "more; mint a token for an existing policy (GET /v1/policies)")
        return found

    async def destination(self, client: Client, host: str, port: int) -> Pinned:
        """The destination check (resolve, classify, pin), once per connection and
        destination: later requests use the address pinned then. Raises Refusal."""
        pinned = client.pins.get((host, port))
        if pinned is None:
            try:
                pinned = await self.guard.check(host, port)
            except Refusal as refusal:
                self.telemetry.count("destinations_refused", refusal.code)
                raise
            if len(client.pins) > _PINS_KEPT:
                client.pins.clear()
            client.pins[(host, port)] = pinned
        return pinned

    def crashed(self, client: Client, **where: Any) -> Refused:
        """The pipeline's own fail-closed boundary: an unexpected error while deciding
        is a refusal (500 gateway_error), logged with its traceback and audited
        (`where`: the audit line's method, host and port)."""
        log.exception("the gate failed while deciding; refusing (fail closed)")
        return Refused(GATEWAY_ERROR, self.trail.refuse(client, GATEWAY_ERROR, close=True,
                                                        **where))

