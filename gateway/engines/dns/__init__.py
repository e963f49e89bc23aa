"""The policy-aware DNS resolver for transparent mode (`listen.dns`).

Known sandboxes (registered, or watched pods with identity.kubernetes) get A/AAAA
answers only for names their policy allows, resolved the way the gateway resolves
destinations; everything else is refused, and nothing is forwarded to another DNS
server: DNS stops being a way around the policy.
`answer` decides (pure), `limit` rate-limits, `server` does the I/O.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.config import Config
from gateway.core.policy import Policy
from gateway.core.ports import Approvals, Registry
from gateway.engines.dns.server import DnsServer
from gateway.net.resolver import DestinationGuard
from gateway.observability.audit import Auditor

__all__ = ["DnsServer", "start_dns"]


async def start_dns(config: Config, registry: Registry, policies: Callable[[str], Policy | None],
                    guard: DestinationGuard, auditor: Auditor, *, shared: bool = False,
                    approvals: Approvals | None = None) -> DnsServer | None:
    """Start the resolver on `listen.dns` (None when it is not set). Its port joins the
    gateway's own addresses, which no sandbox may be proxied to. Raises OSError."""
    if config.listen.dns is None:
        return None
    server = DnsServer(config.dns, registry, policies, guard, auditor, approvals)
    await server.start(config.listen.dns, shared=shared)
    guard.policy.add_own_addresses(server.addresses)
    return server
