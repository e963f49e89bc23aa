"""The running gateway's parts and the policies it serves: the base of `Gateway` and of
the mixins it is made of (`building.py`, `listening.py`, `lifecycle.py`), each a job."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

from uvicorn.server import Server as UvicornServer

from gateway.api.bounds import Bounds
from gateway.config import Config
from gateway.core.addresses import AddressPolicy
from gateway.core.policy import Policy, PolicySet
from gateway.engines.door import Doors
from gateway.net.resolver import (
    DestinationGuard,
    Resolver,
)
from gateway.net.tls import LeafContexts
from gateway.net.upstream_proxy import UpstreamProxy
from gateway.observability.audit import Auditor
from gateway.pipeline.gate import Gate
from gateway.runtime.memory import MemoryGuard
from gateway.runtime.mitmproxy_engine import MitmproxyEngine
from gateway.runtime.relay_link import RelayLink
from gateway.runtime.sweeper import ConnectionSweeper
from gateway.services.approvals import ApprovalService
from gateway.services.dlp.detectors import LazyDetectors
from gateway.services.identity.issued import IssuedTokens
from gateway.services.identity.keywatch import SigningKeyWatcher
from gateway.services.identity.tokens import TokenService
from gateway.services.mcp_oauth import McpOAuthService
from gateway.services.metering import Metering
from gateway.services.minting import Credentials, TokenHttp
from gateway.services.policy import PolicyReloader
from gateway.services.secrets import SecretCache
from gateway.services.state.base import StateStore
from gateway.services.state.health import StoreHealth
from gateway.services.state.log_feed import RequestLog

if TYPE_CHECKING:
    from gateway.engines.dns import DnsServer
    from gateway.engines.mitm import Adapter
    from gateway.observability.otel_process import ExporterProcess
    from gateway.services.identity.kubernetes import PodIdentities


__all__ = ["GatewayParts"]


class GatewayParts:
    """What the running gateway holds (set in `Gateway.__init__` and `Gateway.start`), and
    the policies it serves: the base its parts (`Building`, `Listening`, `Lifecycle`)
    share."""

    config: Config
    worker: int | None
    relay_fd: int | None
    relay: RelayLink | None
    issued: IssuedTokens | None
    resolver: Resolver
    audit_stream: IO[str] | None
    _state: StateStore | None
    mitmproxy: MitmproxyEngine | None
    adapter: Adapter | None
    listeners: list[asyncio.Server]
    admin_server: UvicornServer | None
    admin_bounds: Bounds | None
    _tasks: list[asyncio.Task[Any]]
    _tmp: tempfile.TemporaryDirectory[str] | None
    proxy_address: tuple[str, int] | None
    admin_address: tuple[str, int] | None
    transparent_address: tuple[str, int] | None
    admin_token: str
    admin_token_created: bool
    policy_set: PolicySet | None
    otel: ExporterProcess | None
    doors: Doors | None
    metering: Metering | None
    fd_limit: int
    pool_limit: int
    draining: bool
    _listening: bool
    dns: DnsServer | None
    sweeper: ConnectionSweeper | None
    pods: PodIdentities | None
    approvals: ApprovalService | None
    request_log: RequestLog | None
    memory: MemoryGuard | None
    _loops: list[asyncio.Task[None]]
    proxy: UpstreamProxy | None
    _vault_http: TokenHttp | None
    detectors: LazyDetectors | None
    mcp_oauth: McpOAuthService | None
    # (set in `start`)
    reloader: PolicyReloader
    key_watcher: SigningKeyWatcher
    state: StateStore
    state_health: StoreHealth
    tokens: TokenService
    address_policy: AddressPolicy
    guard: DestinationGuard
    auditor: Auditor
    audit_write: Callable[[dict[str, Any]], None]
    secrets: SecretCache
    credentials: Credentials
    gate: Gate
    handoffs: dict[tuple[str, int], Any]
    leaves: LeafContexts

    # -- state the engines and the admin API read ------------------------------------------

    def policy(self, name: str) -> Policy | None:
        return self.policy_set.get(name) if self.policy_set is not None else None

    def policy_credentials(self, name: str) -> tuple[str, ...] | None:
        """Credential names policy `name` references; None if there is no such policy."""
        policy = self.policy(name)
        return None if policy is None else policy.credential_names

    def policy_token_ttl(self, name: str) -> float | None:
        """Policy `name`'s `tokens: {ttl}` (its tokens' default lifetime), or None."""
        policy = self.policy(name)
        return None if policy is None else policy.token_ttl

    def current_policies(self) -> PolicySet:
        assert self.policy_set is not None
        return self.policy_set
