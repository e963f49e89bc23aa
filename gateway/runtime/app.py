"""Wire the gateway: the gate, its engines, mitmproxy, and the Starlette admin API.

One process, one event loop. The data flow:

    proxy port       → front door  ─┬→ splice (passthrough, protocol: tcp)
    transparent port → transparent ─┼→ HTTP/1 engine (inspected HTTP/1.x)
                       door         └→ mitmproxy + adapter (HTTP/2, started at the
                                       first such client; everything with
                                       network.intercept: mitmproxy)
    every engine → gate (identify → target → admit → credential → leaks → audit)

The listening sockets are bound here, once, and handed to the listeners: a port
another process serves is refused at start, never shared by accident.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import resource
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import urlsplit

import certifi
from uvicorn.config import Config as UvicornConfig
from uvicorn.server import Server as UvicornServer

from gateway.api import probes
from gateway.api.admin import AdminContext, build_admin_app
from gateway.api.bounds import MAX_HEAD, Bounds
from gateway.config import Config, ConfigError, HostPort
from gateway.core.addresses import AddressPolicy
from gateway.core.phrases import error_phrase
from gateway.core.policy import Policy, PolicySet
from gateway.core.secret_value import SecretValue
from gateway.engines import patches
from gateway.engines.door import Doors
from gateway.engines.frontdoor import FrontDoor
from gateway.engines.h1.pool import LIMIT as POOL_LIMIT
from gateway.engines.h1.server import Engine, Limits, Timeouts
from gateway.engines.splice import Splices
from gateway.engines.transparent import TransparentDoor
from gateway.net import ca
from gateway.net.resolver import (
    DestinationGuard,
    Resolver,
    SystemResolver,
    install_backstop,
    local_interface_addresses,
    parse_overrides,
)
from gateway.net.roots import public_roots, verifying_context
from gateway.net.tls import LeafContexts, upstream_context
from gateway.net.upstream_proxy import UpstreamProxy
from gateway.observability import logs, metrics
from gateway.observability.audit import Auditor
from gateway.observability.audit_spill import Spill
from gateway.pipeline.exchange import BODY_HOLD_LIMIT
from gateway.pipeline.gate import Gate
from gateway.runtime.memory import MemoryGuard, ceiling_for
from gateway.runtime.mitmproxy_engine import MitmproxyEngine
from gateway.runtime.relay_link import RelayLink
from gateway.runtime.sweeper import ConnectionSweeper
from gateway.services.approvals import ApprovalService
from gateway.services.approvals.notify import TIMEOUT as NOTIFY_TIMEOUT
from gateway.services.approvals.notify import Webhooks
from gateway.services.dlp.detectors import SALT_FILE, LazyDetectors, ensure_salt
from gateway.services.identity.issued import IssuedTokens
from gateway.services.identity.keywatch import SigningKeyWatcher
from gateway.services.identity.tokens import TokenError, TokenService
from gateway.services.mcp_oauth import McpOAuthService
from gateway.services.metering import Metering, build_metering
from gateway.services.minting import Credentials, TokenHttp, build_credentials
from gateway.services.policy import PolicyError, PolicyReloader
from gateway.services.secrets import SecretCache, SecretError, build_cache, build_store
from gateway.services.state.base import StateStore, StateUnavailable
from gateway.services.state.factory import build_state
from gateway.services.state.health import StoreHealth, unavailable_mode
from gateway.services.state.lease_keeper import slot_of
from gateway.services.state.log import BYTES_PER_LINE
from gateway.services.state.log_feed import RequestLog

if TYPE_CHECKING:
    from mitmproxy.master import Master

    from gateway.engines.dns import DnsServer
    from gateway.engines.mitm import Adapter
    from gateway.observability.otel_process import ExporterProcess
    from gateway.services.identity.kubernetes import PodIdentities

log = logging.getLogger("sandbox_gateway")

BACKLOG = 1024
FD_RESERVE = 64  # descriptors kept for files, DNS, the admin API, Redis


class StartupError(RuntimeError):
    """The gateway cannot start; the message says what to fix."""


class _QuietServer(UvicornServer):
    """uvicorn without its own signal handling: the gateway owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(hp: HostPort, *, shared: bool = False) -> socket.socket:
    """A listening socket on `hp`. Alone, the port is exclusively ours (another instance
    on it is a start-up error naming the address); `shared` (worker processes of one
    supervisor, which reserved the port) uses SO_REUSEPORT."""
    family = socket.AF_INET6 if ":" in hp.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((hp.host, hp.port))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {hp}: {exc.strerror} (is another gateway "
                           "or program serving it?)") from None
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock


def raise_fd_limit() -> int:
    """Raise the open-files soft limit to the hard limit; returns the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return int(soft)


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


class Gateway:
    """The running gateway. `start()` binds everything; `drain()` then `stop()` shut it
    down: readiness off, no new connections, in-flight work finished or cut."""

    def __init__(self, config: Config, *, resolver: Resolver | None = None,
                 audit_stream: IO[str] | None = None, state: StateStore | None = None,
                 worker: int | None = None, relay_fd: int | None = None) -> None:
        self.config = config
        self.worker = worker  # index among worker processes sharing the ports, or None
        self.relay_fd = relay_fd  # this worker's end of the supervisor's revocation relay
        self.relay: RelayLink | None = None
        self.issued: IssuedTokens | None = None  # the record of issued tokens (held writes)
        self.resolver = resolver or SystemResolver()
        self.audit_stream = audit_stream
        self._state = state
        self.mitmproxy: MitmproxyEngine | None = None
        self.adapter: Adapter | None = None
        self.listeners: list[asyncio.Server] = []  # the ports the doors serve (fast mode)
        self.admin_server: UvicornServer | None = None
        self.admin_bounds: Bounds | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.proxy_address: tuple[str, int] | None = None
        self.admin_address: tuple[str, int] | None = None
        self.transparent_address: tuple[str, int] | None = None
        self.admin_token = ""
        self.admin_token_created = False
        self.policy_set: PolicySet | None = None
        self.otel: ExporterProcess | None = None  # telemetry.endpoint set
        self.doors: Doors | None = None
        self.metering: Metering | None = None
        self.fd_limit = 0
        self.pool_limit = 0  # upstream connections kept for a sandbox's next connection
        self.draining = False
        self._listening = False
        self.dns: DnsServer | None = None
        self.sweeper: ConnectionSweeper | None = None
        self.pods: PodIdentities | None = None  # identity.kubernetes
        self.approvals: ApprovalService | None = None  # ask mode
        self.request_log: RequestLog | None = None  # the console's (console.retain)
        self.memory: MemoryGuard | None = None  # releases after bursts; limits.memory
        self._memory_task: asyncio.Task[None] | None = None
        self.proxy: UpstreamProxy | None = None  # network.upstream_proxy
        self._vault_http: TokenHttp | None = None  # Key Vault's client (secrets.store)
        self.detectors: LazyDetectors | None = None  # policies' dlp: (services/dlp)
        self.mcp_oauth: McpOAuthService | None = None  # rules' mcp.oauth (services/mcp_oauth)

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

    def ready(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining: shutting down"
        if self.policy_set is None:
            return False, "policies not loaded"
        if not self._listening:
            return False, "proxy listener not up"
        if self.fd_limit and open_fds() > self.fd_limit - FD_RESERVE:
            return False, (f"out of file descriptors ({open_fds()} of {self.fd_limit} open); "
                           "new connections would fail")
        gate = self.gate
        full = self.memory.refusing if self.memory is not None else None
        if full is not None:
            return False, f"at capacity: {full}; new connections are refused 503 at_capacity"
        if gate is not None and gate.open_connections >= gate.max_connections:
            return False, (f"at capacity: {gate.open_connections} open connections, the "
                           "limit derived from the open-files limit; new connections are "
                           "refused 503 at_capacity")
        if self.proxy is not None and self.proxy.problem is not None:
            return False, (f"{self.proxy.problem}: every upstream dial goes through it "
                           "(network.upstream_proxy.check_ready)")
        stale = self.pods.stale() if self.pods is not None else None
        if stale is not None:
            return True, (f"ready for tokens; pods are not identified: {stale} (their "
                          "connections are refused 503 identity_unavailable)")
        problem = self.auditor.problem
        store = self.state_health.problem
        if store is not None and self.state_health.refusing is not None:
            return False, (f"state store unavailable ({store}): new tunnels and requests are "
                           "refused 503 state_unavailable (state.unavailable: refuse)")
        if problem is None and store is not None:  # (started: listening)
            return True, (f"degraded: state store: {store}; revocations hold on every worker "
                          "of this gateway, what could not be written is written when the "
                          "store is back (state.unavailable: serve)")
        if problem is None and self.state.warning is not None:
            return True, f"ready; {self.state.warning}"
        if problem is not None:
            if self.auditor.refusing is not None:
                return False, (f"audit lines cannot be written ({problem}): new exchanges "
                               "are refused 503 audit_unavailable (audit.on_failure: refuse)")
            return True, (f"ready; audit lines cannot be written ({problem}): serving on, "
                          "lines beyond audit.buffer are dropped (audit.on_failure: continue)")
        return True, "ready"

    def degraded(self) -> list[str]:
        """What serves on in a degraded way now (`/readyz`'s `degraded`)."""
        if self.draining or self.policy_set is None or not self._listening:
            return []
        out = []
        if self.state_health.problem is not None:
            out.append("state store")
        if self.auditor.problem is not None and self.auditor.refusing is None:
            out.append("audit")
        if self.pods is not None and self.pods.stale() is not None:
            out.append("pod identities")
        return out

    def _metering_problems(self, policy_set: PolicySet) -> None:
        assert self.metering is not None
        for problem in self.metering.problems(policy_set):
            log.warning("metering: %s", problem)

    def _on_reload(self, policy_set: PolicySet) -> None:
        self.policy_set = policy_set
        log.info("policies loaded: %d policies, %d rules, revision %s",
                 len(policy_set.policies), policy_set.rule_count, policy_set.revision)
        if self.metering is not None:
            self._metering_problems(policy_set)
        if self.detectors is not None and self._needs_detectors(policy_set) and \
                not self.detectors.built:
            self.detectors.build()  # (now, not on the first request that needs them)

    def _needs_detectors(self, policy_set: PolicySet) -> bool:
        """Outbound credential detection is used: a `dlp:` section, or content exported
        (`telemetry: {content: true}` with an exporter) that it redacts."""
        return policy_set.uses_dlp or (self.config.telemetry.endpoint is not None
                                       and policy_set.exports_content)

    # -- lifecycle -----------------------------------------------------------------------

    def _runtime_dir(self) -> Path:
        if self.config.runtime_dir is not None:
            runtime = self.config.runtime_dir
            if self.worker is not None:
                runtime = runtime / f"worker-{self.worker}"
            runtime.mkdir(parents=True, exist_ok=True)
            return runtime
        self._tmp = tempfile.TemporaryDirectory(prefix="sandbox-gateway-")
        return Path(self._tmp.name)

    def _build_approvals(self, overrides: dict[str, tuple[str, int]]) -> ApprovalService:
        """Ask mode, on the state store every process shares; webhooks sent with the
        gateway's own HTTP client (upstream CA, `network.resolve`, the upstream proxy)."""
        cfg = self.config
        http = TokenHttp(upstream_ca=cfg.network.upstream_ca, overrides=overrides,
                         connector=self._connector(), timeout=NOTIFY_TIMEOUT,
                         connect_timeout=cfg.network.timeouts.connect)
        self.approvals = ApprovalService(
            self.state, audit=self.audit_write, telemetry=metrics.TELEMETRY,
            webhooks=Webhooks(cfg.approvals.notify, self.secrets, http, metrics.TELEMETRY),
            retention=cfg.approvals.retention, policies=self.current_policies,
            directory=cfg.policies, proposals=cfg.approvals.proposals)
        return self.approvals

    async def _mcp_oauth_key(self) -> bytes:
        """The key sealing MCP OAuth tokens: the secret store's `mcp_oauth.key_secret`
        (the same on every replica), else `mcp_oauth.key_file` (made at first start)."""
        from gateway.services.mcp_oauth.seal import KEY_FILE, ensure_key, key_from_secret

        cfg = self.config.mcp_oauth
        if cfg.key_secret is not None:
            if cfg.key_file is not None:
                raise StartupError("mcp_oauth: key_secret and key_file both name the key "
                                   "sealing MCP OAuth tokens; keep one")
            try:
                return key_from_secret((await self.secrets.get(cfg.key_secret)).reveal())
            except SecretError as exc:
                raise StartupError(f"mcp_oauth.key_secret: {exc}") from None
            except ValueError as exc:
                raise StartupError(f"mcp_oauth.key_secret {cfg.key_secret!r}: {exc}"
                                   ) from None
        try:
            return ensure_key(cfg.key_file or self.config.certs / KEY_FILE)
        except (OSError, ValueError) as exc:
            raise StartupError(f"mcp_oauth.key_file: {exc}") from None

    def _build_mcp_oauth(self, key: bytes) -> McpOAuthService:
        """The gateway as MCP servers' OAuth client: its requests go through the
        destination guard (`services/mcp_oauth/http.py`), its tokens sealed in the state
        store with `key` (`_mcp_oauth_key`)."""
        from gateway.services.mcp_oauth.http import OAuthHttp
        from gateway.services.mcp_oauth.seal import Sealer

        cfg = self.config
        context = verifying_context(*public_roots(cfg.network.upstream_ca))
        assert self.admin_address is not None
        host, port = self.admin_address
        shown = f"[{host}]" if ":" in host else host
        self.mcp_oauth = McpOAuthService(
            self.state, self._approvals(),
            OAuthHttp(self.guard, context, connector=self._connector(),
                      timeout=cfg.network.timeouts.connect + 10.0),
            Sealer(key), secrets=self.credentials,
            redirect_url=cfg.mcp_oauth.redirect_url or
            f"http://{shown}:{port}/v1/mcp/oauth/callback",
            clients={name: (c.client_id, c.secret) for name, c in cfg.mcp_oauth.clients.items()},
            client_metadata_url=cfg.mcp_oauth.client_metadata_url,
            audit=self.audit_write)
        return self.mcp_oauth

    def _approvals(self) -> ApprovalService:
        assert self.approvals is not None
        return self.approvals

    def _upstream_bundle(self, runtime: Path) -> Path:
        """Public roots plus `network.upstream_ca` (mitmproxy's option replaces the roots)."""
        bundle = Path(certifi.where()).read_bytes()
        extra = self.config.network.upstream_ca
        if extra is not None:
            try:
                bundle += b"\n" + extra.read_bytes()
            except OSError as exc:
                raise StartupError(f"network.upstream_ca: cannot read {extra}: "
                                   f"{exc.strerror}") from None
        path = runtime / "upstream-ca.pem"
        path.write_bytes(bundle)
        return path

    async def start(self) -> None:
        cfg = self.config
        # mitmproxy runs the loop with asyncio's eager task factory; set here, the loop
        # behaves the same before mitmproxy starts (on demand) as after.
        asyncio.get_running_loop().set_task_factory(asyncio.eager_task_factory)
        try:
            patches.check_versions(aiohttp=cfg.network.upstream_proxy is not None)
        except RuntimeError as exc:
            raise StartupError(str(exc)) from None
        try:
            cert_path, key_path = ca.ensure_ca(cfg.certs)
            runtime = self._runtime_dir()
            confdir = ca.mitmproxy_confdir(cert_path, key_path, runtime)
        except (ca.CAError, OSError) as exc:
            raise StartupError(f"certificate authority: {exc}") from None
        if cfg.admin_token:
            self.admin_token = cfg.admin_token
        else:
            self.admin_token, self.admin_token_created = ca.ensure_admin_token(cfg.certs)

        self.reloader = PolicyReloader(cfg.policies, on_reload=self._on_reload,
                                       learn=cfg.learn)
        try:
            self.policy_set = self.reloader.load_now()
        except PolicyError as exc:
            raise StartupError(f"policies in {cfg.policies} are invalid:\n"
                               + "\n".join(exc.errors)) from None
        try:  # (the salt never logged; the detectors built now only if a policy needs them)
            self.detectors = LazyDetectors(
                ensure_salt(cfg.dlp.salt_file or cfg.certs / SALT_FILE), BODY_HOLD_LIMIT)
        except (OSError, ValueError) as exc:
            raise StartupError(f"dlp.salt_file: {exc}") from None
        if self._needs_detectors(self.policy_set):
            self.detectors.build()
        self.key_watcher = SigningKeyWatcher(cfg.signing_dir, cfg.tokens.retired_kids)
        try:
            keys = self.key_watcher.load_now()
        except (TokenError, OSError) as exc:
            raise StartupError(f"signing keys: {exc}") from None
        try:
            self.state: StateStore = self._state or build_state(cfg.state)
            self.state_health = StoreHealth(self.state, unavailable_mode(cfg.state))
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        try:
            await self.state.start()
            # The holder of this process's budget reservations (state/leases.py): taken
            # before any call is admitted; a process that ran in this slot before and
            # died has its unsettled reservations charged now.
            await self.state.take_lease(slot_of(self.worker, str(cfg.listen.proxy)))
        except StateUnavailable as exc:
            raise StartupError(f"state store: {exc}") from None
        self.tokens = TokenService(
            keys, self.state, self.policy_credentials,
            issuer=cfg.tokens.issuer, default_ttl=cfg.tokens.default_ttl,
            max_ttl=cfg.tokens.max_ttl, max_lifetime=cfg.tokens.max_lifetime,
            leeway=cfg.tokens.leeway, policy_ttl=self.policy_token_ttl,
        )
        await self._open_relay()
        self.issued = IssuedTokens(self.state, self.tokens.revocations.is_revoked)
        self.issued.start()  # (records the store could not take: retried)

        self.fd_limit = raise_fd_limit()
        # The upstream pool's descriptors come out of the connection cap (an eighth of
        # the budget at most, engines/h1/pool.py LIMIT at most).
        if cfg.network.intercept == "fast":
            self.pool_limit = min(POOL_LIMIT, max(0, self.fd_limit - FD_RESERVE) // 8)
        shared = self.worker is not None
        proxy_sock = bind(cfg.listen.proxy, shared=shared)
        self.proxy_address = proxy_sock.getsockname()[:2]
        admin_sock = bind(cfg.listen.admin, shared=shared)
        self.admin_address = admin_sock.getsockname()[:2]
        sockets = {("regular", self.proxy_address[1]): proxy_sock}
        if cfg.listen.transparent is not None:
            transparent_sock = bind(cfg.listen.transparent, shared=shared)
            self.transparent_address = transparent_sock.getsockname()[:2]
            sockets[("transparent", self.transparent_address[1])] = transparent_sock

        self.address_policy = AddressPolicy(
            allow_cidrs=cfg.network.allow_cidrs, deny_cidrs=cfg.network.deny_cidrs,
            own_addresses=[a for a in (self.proxy_address, self.admin_address,
                                       self.transparent_address) if a is not None],
            local_addresses=local_interface_addresses(),
        )
        try:
            overrides = parse_overrides(cfg.network.resolve)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        self.guard = DestinationGuard(self.address_policy, self.resolver, overrides=overrides)
        install_backstop(self.address_policy, everywhere=False)
        try:
            self.auditor = Auditor.open(cfg.audit.path, self.audit_stream, worker=self.worker,
                                        on_failure=cfg.audit.on_failure,
                                        buffer=cfg.audit.buffer, spill=self._audit_spill())
        except OSError as exc:
            where = f"audit.path: cannot open {cfg.audit.path}" if cfg.audit.path else \
                "audit: cannot write to stdout"
            raise StartupError(f"{where}: {exc.strerror or exc}") from None
        self.auditor.start()  # (a previous run's spilled lines first)
        self.audit_write = self.auditor.write
        if cfg.console.retain or cfg.console.retain_bytes:  # audit lines also to the console
            self.state.log_retain = cfg.console.retain
            self.state.log_retain_bytes = cfg.console.retain_bytes or \
                cfg.console.retain * BYTES_PER_LINE
            self.request_log = RequestLog(self.state)
            self.auditor.tap = self.request_log.add
            try:  # (its file opened now: one that cannot be used is said at once)
                await self.state.log_last()
            except StateUnavailable as exc:
                log.warning("request log: %s; the console's request log is held and "
                            "retried (the audit trail is not affected)", exc)
        self.otel = self._otel_exporter()  # (taps the audit lines the sink writes)
        self.proxy = self._build_proxy()
        try:
            self.secrets: SecretCache = build_cache(
                build_store(cfg.secrets, transport=self._vault_transport(overrides)),
                cfg.secrets)
        except (ValueError, SecretError) as exc:
            raise StartupError(str(exc)) from None
        self.secrets.on_change = logs.SOURCES.changed  # (and the minted values' cache)
        self.state.ephemeral.on_change = logs.SOURCES.changed  # (provider-minted secrets)
        try:
            self.metering = build_metering(cfg, self.state, self.state.ephemeral,
                                           metrics.TELEMETRY)
        except ConfigError as exc:
            raise StartupError(str(exc)) from None
        self._metering_problems(self.current_policies())
        self.credentials = self._build_credentials(overrides)
        await self._start_pods()
        self.memory = self._memory_guard()
        oauth_key = await self._mcp_oauth_key()
        self.gate = Gate(
            tokens=self.tokens, policies=self.current_policies, guard=self.guard,
            secrets=self.credentials, registry=self.state, audit=self.audit_write,
            resolve=self.guard.resolver.resolve, metering=self.metering,
            signers=self.credentials, ephemeral=self.state.ephemeral,
            audit_health=self.auditor, telemetry=metrics.TELEMETRY,
            refusals_inside_tls=cfg.refusals.inside_tls,
            connections_per_sandbox=cfg.limits.connections_per_sandbox,
            max_connections=max(16, (self.fd_limit - FD_RESERVE - self.pool_limit) // 2),
            workloads=self.pods, approvals=self._build_approvals(overrides),
            pins=self._approvals().pins, state_health=self.state_health,
            capacity=self.memory, detectors=self.detectors,
            mcp_tokens=self._build_mcp_oauth(oauth_key))
        if self.otel is not None:  # (policies with telemetry: {content: true} export it)
            self.gate.parts.trail.content_sink = functools.partial(
                self.otel.feed.with_content, self.audit_write, logs.REDACTION.redact)
        # (the grants and tool pins that outlived a restart; then what is written anywhere)
        await self._approvals().start()
        await self._start_dns(shared)

        t = cfg.network.timeouts
        timeouts = Timeouts(connect=t.connect, read=t.read, client_idle=t.client_idle,
                            handshake=t.handshake)
        limits = Limits(max_header_bytes=cfg.limits.max_header_bytes,
                        max_websocket_message=cfg.limits.max_websocket_message)
        bundle = self._upstream_bundle(runtime)
        self.handoffs: dict[tuple[str, int], Any] = {}
        loop = asyncio.get_running_loop()
        if cfg.network.intercept == "fast":
            self.leaves = LeafContexts.from_confdir(confdir, runtime)
            roots = upstream_context(*public_roots(cfg.network.upstream_ca))
            h1 = Engine(self.gate, self.leaves, roots, timeouts=timeouts,
                        limits=limits, upstream_idle=cfg.network.upstream_idle_timeout,
                        pool_limit=self.pool_limit, proxy=self.proxy)
            splices = Splices(self.gate, idle=t.client_idle,
                              lifetime=cfg.limits.max_tunnel_lifetime, connect=t.connect,
                              proxy=self.proxy)
            self.doors = doors = Doors(self.gate, h1, splices, timeouts, limits,
                                       handoffs=self.handoffs)
            servers: dict[tuple[str, int], asyncio.Server] = {}
            self.mitmproxy = MitmproxyEngine(
                lambda: self._build_master(confdir, bundle, servers=servers),
                abandoned=self._abandoned)
            for (mode, port), sock in sockets.items():
                door = FrontDoor if mode == "regular" else TransparentDoor
                handoff = self.mitmproxy.handoff(mode)
                servers[(mode, port)] = await loop.create_server(
                    lambda door=door, handoff=handoff: door(doors, handoff),  # type: ignore[misc]
                    sock=sock)
            self.listeners = list(servers.values())
        else:
            self.mitmproxy = MitmproxyEngine(
                lambda: self._build_master(confdir, bundle, sockets=sockets),
                abandoned=self._abandoned)

        # every wait of the admin listener bounded too; probes answered past its cap
        self.admin_bounds = bounds = Bounds(
            cfg.admin, probe=lambda path: probes.answer(path, self),
            chunk_left=patches.chunk_left, max_chunk=patches.MAX_CHUNK)
        app = bounds.wrap(build_admin_app(AdminContext(
            admin_token=self.admin_token, tokens=self.tokens,
            policies=self.current_policies, readiness=self, guard=lambda: self.guard,
            metering=self.metering, pods=self.pods, approvals=self.approvals,
            request_log=self.state if self.request_log is not None else None,
            stopping=lambda: self.draining, trusted_proxies=cfg.console.trusted_proxies,
            issued_tokens=self.issued, policies_dir=cfg.policies, mcp_oauth=self.mcp_oauth,
        )))
        self.admin_server = _QuietServer(UvicornConfig(
            # (no forwarded header is read by uvicorn: console.trusted_proxies decides)
            app, log_level="warning", access_log=False, lifespan="off", http=bounds.protocol,
            proxy_headers=False,
            ws="none", timeout_keep_alive=max(1, math.ceil(cfg.admin.timeouts.idle)),
            h11_max_incomplete_event_size=MAX_HEAD))
        if not self.listeners:  # network.intercept: mitmproxy serves the ports
            try:
                await self.mitmproxy.start()
            except RuntimeError as exc:
                raise StartupError(str(exc)) from None
        self._tasks.append(loop.create_task(self.admin_server.serve(sockets=[admin_sock]),
                                            name="admin"))
        self.reloader.start()
        if self.proxy is not None and self.proxy.settings.check_ready:
            self._tasks.append(loop.create_task(self.proxy.watch(t.connect),
                                                name="upstream-proxy-probe"))
        self._memory_task = loop.create_task(self.memory.run(), name="memory")
        # revoked tokens' and grants' connections end
        self.sweeper = ConnectionSweeper(self.gate, self.approvals)
        self.sweeper.start()
        self.key_watcher.start(self.tokens.use_keys)  # rotated keys sign without a restart
        logs.SOURCES.add(self._log_source, self._log_secrets)  # what logs must not show
        logs.protect()  # uvicorn's and mitmproxy's handlers too, now that they exist
        await self._wait_listening()

    async def _open_relay(self) -> None:
        """A worker: its end of the supervisor's revocation relay, opened before it serves
        (the revocations the store does not have yet come first); then revocations hold
        here as other workers take them. Owed store writes are retried either way."""
        revocations = self.tokens.revocations
        if self.relay_fd is not None:
            try:
                self.relay = await RelayLink.open(self.relay_fd)
            except (OSError, ValueError, TimeoutError) as exc:
                raise StartupError(f"the supervisor's revocation relay: {exc}") from None
            revocations.relay = self.relay
            revocations.adopt(self.relay.snapshot)
            for jti, expires_at in self.relay.early:
                revocations.learn(jti, expires_at)
            self.relay.start(revocations.learn)
        revocations.start()

    def _memory_guard(self) -> MemoryGuard:
        """Memory given back after bursts, and the ceiling `limits.memory` (a share of
        the container's limit is split between the workers: runtime/memory.py)."""
        limits = self.config.limits
        workers = max(1, self.config.workers) if self.worker is not None else 1
        ceiling, warning = ceiling_for(limits.memory, limits.memory_percent, workers)
        if warning is not None:
            log.warning("%s", warning)

        def compact() -> None:
            self.gate.connections.compact()
            if self.doors is not None:
                self.doors.compact()

        return MemoryGuard(ceiling, open_connections=lambda: self.gate.open_connections,
                           compact=compact)

    def _otel_exporter(self) -> ExporterProcess | None:
        """The OpenTelemetry exporter process (`telemetry.endpoint`) fed every audit line
        the sink writes, or None: off (gateway/observability/otel_process.py). The SDK is
        imported only in that process, never here."""
        tel = self.config.telemetry
        if tel.endpoint is None:
            return None
        from gateway.observability.otel_feed import OtelFeed
        from gateway.observability.otel_process import ExporterProcess

        def preset_of(credential: str | None) -> str | None:
            found = self.current_policies().credentials.get(credential or "")
            return None if found is None else found.preset

        feed = OtelFeed(traces=tel.traces, logs=self.config.audit.otlp,
                        metrics_on=tel.metrics, sample=tel.sample, queue=tel.queue,
                        preset_of=preset_of)
        exporter = ExporterProcess({
            "endpoint": tel.endpoint, "protocol": tel.protocol, "headers": dict(tel.headers),
            "traces": tel.traces, "logs": self.config.audit.otlp,
            "metrics_on": tel.metrics, "service_name": tel.service_name,
            "queue": tel.queue, "metrics_interval": tel.metrics_interval,
            "worker": self.worker}, feed)
        try:
            exporter.start()
        except OSError as exc:
            raise StartupError(f"telemetry: cannot start the exporter process: {exc}") from None
        exporter.watch()  # (restarts it if it exits)
        tap = self.auditor.tap
        if tap is None:
            self.auditor.tap = feed.tap
        else:
            def both(record: dict[str, Any], now: float, line: bytes) -> None:
                try:
                    tap(record, now, line)
                finally:
                    feed.tap(record, now, line)
            self.auditor.tap = both
        return exporter

    def _audit_spill(self) -> Spill | None:
        """The audit spill journal (`audit.spill`; None with `max: 0`). A worker keeps its
        own segments; a single process takes every worker's a previous run left."""
        spill = self.config.audit.spill
        if not spill.max or spill.path is None:
            return None
        try:
            return Spill(spill.path, spill.max, owner=self.worker or 0,
                         adopt_all=self.worker is None)
        except OSError as exc:
            raise StartupError(
                f"audit.spill.path: cannot use {spill.path}: {exc.strerror or exc} (a "
                "writable directory, on another volume than audit.path; audit.spill.max: 0 "
                "runs without a spill journal)") from None

    # -- what the logs must never show (gateway/observability/logs.py) ----------------------------

    @property
    def _log_source(self) -> str:
        return f"gateway-{id(self)}"

    def _log_secrets(self) -> list[SecretValue | str]:
        """Every key and minted value fetched so far, every secret a provider minted for a
        sandbox and its alias, and the claims every token starts with (a token whose
        header was cut off)."""
        values: list[SecretValue | str] = [v for _, v in self.credentials.known_items()]
        for minted in self.state.ephemeral.live():
            values += [minted.value] if minted.alias is None else [minted.value, minted.alias]
        return [*values, logs.token_claims(self.config.tokens.issuer)]

    # -- credentials the gateway mints (services/minting/), kept apart from the proxy wiring ---

    def _build_credentials(self, overrides: dict[str, tuple[str, int]]) -> Credentials:
        """The gate's secrets port: the secret cache, plus minted credentials (GitHub
        App, Entra ID, AWS, Google, OAuth2) whose token endpoints are reached with the
        public roots + `network.upstream_ca` and `network.resolve`."""
        upstream_ca = self.config.network.upstream_ca
        return build_credentials(self.secrets, self.current_policies,
                                 upstream_ca=upstream_ca, overrides=overrides,
                                 timeout=self.config.network.timeouts.connect + 5.0,
                                 share=self.state, connector=self._connector())

    # -- the upstream (corporate) proxy (net/upstream_proxy.py), kept apart from the wiring ----

    def _build_proxy(self) -> UpstreamProxy | None:
        """`network.upstream_proxy`: every upstream dial (each engine's, the token
        endpoints', Key Vault's) goes through it, to the address the gateway checked."""
        settings = self.config.network.upstream_proxy
        if settings is None:
            return None
        tls = None
        if settings.scheme == "https":
            tls = verifying_context(*public_roots(self.config.network.upstream_ca))
        log.info("upstream proxy: %s (connect_to: %s%s%s)", settings.where,
                 settings.connect_to, f", no_proxy: {', '.join(settings.no_proxy.entries)}"
                 if settings.no_proxy.entries else "",
                 ", credentials from the environment" if settings.userinfo is not None
                 else f", credentials: secret {settings.credentials}"
                 if settings.credentials else "")
        return UpstreamProxy(settings, secret=lambda name: self.secrets.get(name), tls=tls)

    def _connector(self) -> Callable[..., Any] | None:
        """How the gateway's own HTTP client connects: through the upstream proxy (the
        aiohttp hook is a private one: engines/patches.py), else aiohttp's own way."""
        return None if self.proxy is None else patches.proxied_connector(self.proxy)

    def _vault_transport(self, overrides: dict[str, tuple[str, int]]) -> Any:
        """Key Vault's transport (`secrets.store: azure-keyvault`): the gateway's own
        client (public roots + network.upstream_ca, network.resolve, the upstream proxy,
        never the process's HTTPS_PROXY); None for the other stores."""
        if self.config.secrets.get("store") != "azure-keyvault":
            return None
        proxy = self.proxy
        vault = str(self.config.secrets.get("vault_url") or "")
        host = (urlsplit(vault).hostname or "").lower()
        if proxy is not None and proxy.settings.credentials is not None \
                and proxy.applies(host, None, 443):
            raise StartupError(
                "network.upstream_proxy.credentials: Key Vault is reached through the "
                "upstream proxy, so the proxy's credentials cannot be read from it; list "
                f"{host or 'the vault'} in network.upstream_proxy.no_proxy or use "
                "network.upstream_proxy: env (credentials in the proxy URL)")
        self._vault_http = TokenHttp(upstream_ca=self.config.network.upstream_ca,
                                     overrides=overrides, connector=self._connector(),
                                     timeout=self.config.network.timeouts.connect + 5.0)
        return self._vault_http.azure_transport()

    # -- Kubernetes pod identity (services/identity/kubernetes/), only when enabled ------------

    async def _start_pods(self) -> None:
        """Watch the sandbox namespaces' pods (identity.kubernetes); kubernetes_asyncio
        is imported only then."""
        if not self.config.identity.kubernetes.enabled:
            return
        from gateway.services.identity.kubernetes import PodIdentities

        self.pods = PodIdentities(self.config.identity.kubernetes, self.tokens,
                                  self.current_policies)
        try:
            await self.pods.start()
        except Exception as exc:  # a kubeconfig or service account that cannot be used
            raise StartupError(f"identity.kubernetes: cannot use the Kubernetes API: "
                               f"{type(exc).__name__}: {exc}") from None

    # -- the DNS resolver (gateway/engines/dns/), kept apart from the proxy wiring -------------

    async def _start_dns(self, shared: bool) -> None:
        """Start the policy-aware DNS resolver when `listen.dns` is set (dnspython is
        imported only then)."""
        if self.config.listen.dns is None:
            return
        from gateway.engines.dns import start_dns

        try:
            # (who a query is from: the gate's identifier, registrations and pods alike)
            self.dns = await start_dns(self.config, self.gate.identities, self.policy,
                                       self.guard, self.auditor, shared=shared,
                                       approvals=self.approvals)
        except OSError as exc:
            raise StartupError(f"cannot listen on listen.dns {self.config.listen.dns}: "
                               f"{exc.strerror or exc}") from None

    async def _stop_dns(self) -> None:
        if self.dns is not None:
            await self.dns.close()

    def _build_master(self, confdir: Path, upstream_bundle: Path, *,
                      sockets: dict[tuple[str, int], socket.socket] | None = None,
                      servers: dict[tuple[str, int], asyncio.Server] | None = None) -> Master:
        """mitmproxy with the gateway's adapter, on the ports' `sockets` (it serves them)
        or taking the `servers` the doors serve (started on demand)."""
        from mitmproxy import options
        from mitmproxy.addons import core, proxyserver, tlsconfig
        from mitmproxy.master import Master

        from gateway.engines.idle import IdleUpstreams
        from gateway.engines.mitm import STREAM_LARGE_BODIES, Adapter, error_h2, error_page

        patches.install_error_pages(error_page, error_h2)
        patches.install_h1_framing()
        patches.install_stream_refusal()
        patches.install_log_hygiene(error_phrase)
        patches.install_listeners(sockets=sockets, servers=servers)

        opts = options.Options()
        master = Master(opts, event_loop=asyncio.get_running_loop())
        self.adapter = Adapter(self.gate, self.handoffs, proxy=self.proxy,
                               connect_timeout=self.config.network.timeouts.connect)
        server = proxyserver.Proxyserver()
        self.adapter.proxyserver = server
        master.addons.add(
            core.Core(),
            server,
            tlsconfig.TlsConfig(),
            # No errorcheck.ErrorCheck: the gateway validates its own startup, and
            # ErrorCheck exits on *any* error logged process-wide during startup.
            self.adapter,
            IdleUpstreams(self.config.network.upstream_idle_timeout, server),
        )
        logs.protect()  # (mitmproxy's handlers too)
        assert self.proxy_address is not None
        host, port = self.proxy_address
        modes = [f"regular@{host}:{port}"]
        if self.transparent_address is not None:
            thost, tport = self.transparent_address
            modes.append(f"transparent@{thost}:{tport}")
        opts.update(
            mode=modes,
            confdir=str(confdir),
            ssl_verify_upstream_trusted_ca=str(upstream_bundle),
            ssl_insecure=False,
            connection_strategy="lazy",
            upstream_cert=False,
            rawtcp=False,
            http2=True,
            websocket=True,
            stream_large_bodies=str(STREAM_LARGE_BODIES),
            store_streamed_bodies=False,
        )
        return master

    def _abandoned(self, peer: tuple[str, int]) -> None:
        """A client handed to mitmproxy, which did not start: its tunnel ends, audited."""
        client = self.handoffs.pop(peer, None)
        if client is not None:
            try:
                self.gate.tunnel_closed(client, None, None, "engine_failed")
            finally:
                self.gate.closed(client)

    def _listen_addrs(self) -> list[tuple[str, int]]:
        if self.listeners:
            return [sock.getsockname()[:2] for server in self.listeners
                    for sock in server.sockets]
        assert self.mitmproxy is not None and self.mitmproxy.master is not None
        ps = self.mitmproxy.master.addons.get("proxyserver")
        return [addr for server in ps.servers for addr in server.listen_addrs]

    async def _wait_listening(self) -> None:
        for _ in range(500):
            if self.admin_server is not None and self.admin_server.started:
                self.address_policy.add_own_addresses(self._listen_addrs())
                self._listening = True
                metrics.POLICY_RULES.set(self.current_policies().rule_count)
                return
            for task in self._tasks:
                if task.done():
                    exc = task.exception()
                    raise StartupError(f"{task.get_name()} failed to start: {exc}")
            await asyncio.sleep(0.01)
        raise StartupError("listeners did not come up within 5 s")

    async def _close_listeners(self) -> None:
        for server in self.listeners:
            server.close()
        if self.mitmproxy is not None and self.mitmproxy.master is not None:
            # mitmproxy's Done hook leaves its listeners open: close them explicitly.
            await self.mitmproxy.master.addons.get("proxyserver").servers.update([])

    def in_flight(self) -> int:
        """Requests and streams still being served (what a drain waits for)."""
        count = sum(1 for conn in self.doors.h1.connections if conn.exchange is not None) \
            if self.doors is not None else 0
        return count + (self.adapter.in_flight() if self.adapter is not None else 0)

    async def drain(self, timeout: float | None = None) -> None:
        """Graceful shutdown, first half: readiness goes 503 at once, no new connections
        are accepted, idle connections close, and in-flight requests and streams run to
        completion for at most `shutdown.drain` seconds."""
        self.draining = True
        self._listening = False
        await self._close_listeners()
        limit = self.config.shutdown.drain if timeout is None else timeout
        deadline = time.monotonic() + limit
        if self.doors is not None:
            self.doors.h1.draining = True
        while time.monotonic() < deadline:
            if self.doors is not None:
                self.doors.h1.close_idle()
            if self.in_flight() == 0:
                break
            await asyncio.sleep(0.05)
        left = self.in_flight()
        if left:
            log.warning("drain: %d request(s) still in flight after %gs; cutting them off",
                        left, limit)

    async def stop(self) -> None:
        self._listening = False
        self.draining = True  # (also without a drain first: long admin answers end)
        if self.admin_server is not None:
            self.admin_server.should_exit = True
        if self.mitmproxy is not None:
            await self._close_listeners()
            if self.doors is not None:
                self.doors.close_all()
            self.mitmproxy.shutdown()
            if self.mitmproxy.task is not None:
                self._tasks.append(self.mitmproxy.task)
        await self._stop_dns()
        if self.pods is not None:
            await self.pods.close()
        await self.reloader.stop()
        await self.key_watcher.stop()
        if self.sweeper is not None:
            await self.sweeper.stop()
        if self._memory_task is not None:
            self._memory_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._memory_task
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, timeout=5)
        self._tasks.clear()
        if self.admin_bounds is not None:  # (uvicorn closed its own and the listener)
            self.admin_bounds.close()  # connections past its cap waiting for a probe
        if self.mcp_oauth is not None:
            await self.mcp_oauth.close()
        if self.approvals is not None:
            await self.approvals.close()  # (notifications still being sent: cancelled)
        if self.request_log is not None:
            await self.request_log.aclose()  # (its last lines, before the store closes)
        if self.issued is not None:
            await self.issued.stop()
        await self.tokens.revocations.stop()  # (a last try at what the store has not got)
        if self.relay is not None:
            await self.relay.close()
        await self.state.close()
        await self.credentials.close()  # the secret cache and the minted values' cache
        if self._vault_http is not None:
            await self._vault_http.close()
        logs.SOURCES.remove(self._log_source)
        await self.auditor.aclose()
        if self.otel is not None:  # (what is queued exported by the exporter process)
            await self.otel.close()
        if self.doors is not None:
            self.leaves.close()
        if self._tmp is not None:
            self._tmp.cleanup()
