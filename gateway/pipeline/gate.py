"""The gate: the one place every engine asks "may this pass?", in data-flow order.

    identify → target → admit (policy, destination, pin) → credential → leaks → audit

Engines (the front door and its splice, the HTTP/1 engine, the mitmproxy adapter,
transparent mode) translate their native objects into `Client`, authorities and
`RequestHead`s, call the gate, and apply what comes back: a `Tunnel` or `Exchange`
to serve, or an `Answer` to send. They decide nothing themselves: even input they
cannot parse is reported here (`unparsable`). Every refusal is audited, once, with the
same fields for every engine (`core/trail.Trail`).

The gate only composes the pipeline's units, one job each, over the parts they share
(`parts.Parts`: the ports, the audit trail, connection counts, identities, leak
markers): `tunnels` (connection admission), `requests` (request admission),
`asking` (stage 1 and ask mode), `signing` (secret fetch and signing), `sweep`
(ending what no longer holds); the body stage runs in the `Exchange` a request gets.
They decide with the pure core (`core/evaluate`, `target`, `credentials`, `leaks`) and
reach the outside only through `core/ports.py`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.core.client import Client, Refused, Tunnel
from gateway.core.local_api import INTERNAL_HOST
from gateway.core.mcp_pins import ToolPins
from gateway.core.messages import RequestHead
from gateway.core.policy import PolicySet
from gateway.core.ports import (
    NO_MINTED_SECRETS,
    SILENT,
    Approvals,
    AuditHealth,
    Capacity,
    Detectors,
    Guard,
    McpTokens,
    Metering,
    MintedSecrets,
    Registry,
    Secrets,
    Signers,
    StateHealth,
    Telemetry,
    Tokens,
    Workloads,
)
from gateway.core.refusal import GATEWAY_ERROR, Answer, Refusal
from gateway.core.trail import Trail
from gateway.pipeline.asking import Asking
from gateway.pipeline.connections import Connections
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.identify import Identifier
from gateway.pipeline.markers import Markers
from gateway.pipeline.parts import Parts
from gateway.pipeline.requests import Requests
from gateway.pipeline.signing import Signing
from gateway.pipeline.sweep import Sweep
from gateway.pipeline.tunnels import Tunnels
from gateway.pipeline.unpacking import UnpackBudgets

log = logging.getLogger("sandbox_gateway")

__all__ = ["INTERNAL_HOST", "Client", "Gate", "Refused", "Tunnel"]


class Gate:
    """See the module docstring. One per gateway process; engines share it."""

    def __init__(self, *, tokens: Tokens, policies: Callable[[], PolicySet],
                 guard: Guard, secrets: Secrets, registry: Registry,
                 audit: Callable[[dict[str, Any]], None],
                 resolve: Callable[[str, int], Awaitable[list[str]]] | None = None,
                 metering: Metering | None = None, signers: Signers | None = None,
                 ephemeral: MintedSecrets | None = None, audit_health: AuditHealth | None = None,
                 connections_per_sandbox: int = 256, max_connections: int = 1 << 30,
                 telemetry: Telemetry = SILENT, clock: Callable[[], float] = time.time,
                 refusals_inside_tls: bool = False, workloads: Workloads | None = None,
                 approvals: Approvals | None = None, pins: ToolPins | None = None,
                 state_health: StateHealth | None = None,
                 capacity: Capacity | None = None,
                 detectors: Detectors | None = None,
                 mcp_tokens: McpTokens | None = None,
                 unpacking: UnpackBudgets | None = None) -> None:
        connections = Connections(per_sandbox=connections_per_sandbox,
                                  limit=max_connections, telemetry=telemetry,
                                  capacity=capacity)
        minted = ephemeral if ephemeral is not None else NO_MINTED_SECRETS
        self.parts = Parts(
            tokens=tokens, policies=policies, guard=guard, secrets=secrets,
            trail=Trail(audit, policies, telemetry, clock), connections=connections,
            identities=Identifier(tokens, registry, connections, workloads, policies),
            markers=Markers(policies, secrets, minted, lambda: tokens.issuer),
            telemetry=telemetry, metering=metering, signers=signers, ephemeral=minted,
            audit_health=audit_health, state_health=state_health, approvals=approvals,
            pins=pins, refusals_inside_tls=refusals_inside_tls, detectors=detectors,
            mcp_tokens=mcp_tokens)
        if unpacking is not None:
            self.parts.unpacking = unpacking
        self.parts.markers.oauth = mcp_tokens
        if resolve is not None:
            self.parts.resolve = resolve
        self.asking = Asking(self.parts)
        self.tunnels = Tunnels(self.parts, self.asking)
        self.requests = Requests(self.parts, self.asking, Signing(self.parts))
        self._sweep = Sweep(self.parts, self.asking)

    # -- what the runtime switches, and what it reads -----------------------------------

    @property
    def metering(self) -> Metering | None:
        return self.parts.metering

    @metering.setter
    def metering(self, metering: Metering | None) -> None:
        self.parts.metering = metering

    @property
    def state_health(self) -> StateHealth | None:
        return self.parts.state_health

    @state_health.setter
    def state_health(self, health: StateHealth | None) -> None:
        self.parts.state_health = health

    @property
    def connections(self) -> Connections:
        return self.parts.connections

    @property
    def identities(self) -> Identifier:
        return self.parts.identities

    @property
    def open_connections(self) -> int:
        return self.parts.connections.open

    @property
    def max_connections(self) -> int:
        return self.parts.connections.limit

    # -- connections ---------------------------------------------------------------------

    def opened(self, client: Client) -> None:
        """A client connection was accepted (counted until `closed`). Past the global cap
        (derived from the open-files limit), or while the process's `capacity` port says
        it has no room (its memory ceiling), raises Refused: the engine answers 503
        at_capacity and closes, before the process runs out of descriptors or memory for
        everyone."""
        refusal = self.parts.connections.opened(client)
        if refusal is not None:
            raise Refused(refusal, self.parts.trail.refuse(client, refusal, close=True))

    def closed(self, client: Client) -> None:
        """The client connection ended, whichever engine served it (idempotent). A
        tunnel it still holds is audited now if it has no line yet (`tunnel_closed`)."""
        if client.tunnel is not None:
            self.tunnels.closed(client, None, None)
        self.parts.connections.closed(client)

    def sweep(self) -> int:
        """End every open connection whose identity no longer holds (`sweep.Sweep`)."""
        return self._sweep.run()

    def unparsable(self, client: Client, reason: str, *, host: str | None = None,
                   port: int | None = None) -> Answer:
        """What a client sent cannot be read as HTTP (`reason` names what, in the
        engine's fixed words): refused `bad_request`, audited, the connection closes."""
        refusal = Refusal("bad_request", reason)
        return self.parts.trail.refuse(client, refusal, host=host, port=port, close=True)

    def failed(self, client: Client, *, host: str | None = None,
               port: int | None = None) -> Answer:
        """An engine failed unexpectedly serving `client`: logged with the traceback,
        refused `gateway_error` (fail closed) and audited."""
        log.exception("an engine failed; refusing (fail closed)")
        return self.parts.trail.refuse(client, GATEWAY_ERROR, host=host, port=port,
                                       close=True)

    # -- tunnels (pipeline/tunnels.py) ----------------------------------------------------

    async def connect(self, client: Client, authority: str, proxy_authorization: str | None,
                      *, started: float | None = None) -> Tunnel:
        """Admit a CONNECT (`Tunnels.connect`). Raises Refused."""
        return await self.tunnels.connect(client, authority, proxy_authorization,
                                          started=started)

    def answer_inside(self, refused: Refused, head: RequestHead) -> Answer:
        """The answer to a refused CONNECT inside its TLS (`Tunnels.answer_inside`)."""
        return self.tunnels.answer_inside(refused, head)

    def identify_registered(self, client: Client, orig: tuple[str, int]) -> bool:
        """Identify a redirected connection by its source (`Tunnels`). Raises Refused."""
        return self.tunnels.identify_registered(client, orig)

    async def open_transparent(self, client: Client, orig: tuple[str, int], kind: str,
                               name: str | None) -> Tunnel:
        """Admit a redirected connection (`Tunnels.open_transparent`). Raises Refused."""
        return await self.tunnels.open_transparent(client, orig, kind, name)

    def check_hello(self, client: Client, sni: str | None, *, tls: bool) -> None:
        """A tunnel's first bytes (`Tunnels.check_hello`). Raises Refused."""
        self.tunnels.check_hello(client, sni, tls=tls)

    def tunnel_closed(self, client: Client, bytes_in: int | None, bytes_out: int | None,
                      error: str | None = None) -> None:
        """A tunnel ended: its one audit line (`Tunnels.closed`)."""
        self.tunnels.closed(client, bytes_in, bytes_out, error)

    # -- requests (pipeline/requests.py) --------------------------------------------------

    async def begin(self, client: Client, head: RequestHead, *, tls: bool,
                    proxy_authorization: str | None = None) -> Exchange | Answer:
        """Admit one request (`Requests.begin`): the exchange to serve, or the answer."""
        return await self.requests.begin(client, head, tls=tls,
                                          proxy_authorization=proxy_authorization)
