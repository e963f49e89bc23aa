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

`Gateway` is `start` and its parts, a module each: `building.py` (the services built at
start), `listening.py` (the ports bound, the doors and engines on them, the DNS
resolver, mitmproxy's master), `lifecycle.py`
(readiness, the drain, the stop), over `parts.py` (what the gateway holds);
`startup.py` binds the sockets and raises the open-files limit.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import socket
import tempfile
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from uvicorn.config import Config as UvicornConfig
from uvicorn.server import Server as UvicornServer

from gateway.api import probes
from gateway.api.admin import AdminContext, build_admin_app
from gateway.api.bounds import MAX_HEAD, Bounds
from gateway.config import Config, ConfigError
from gateway.core.policy import PolicySet
from gateway.core.policy.hosts import compile_host_pattern
from gateway.engines import patches
from gateway.engines.door import Doors
from gateway.net import ca
from gateway.net.resolver import (
    Resolver,
    SystemResolver,
)
from gateway.net.upstream_proxy import UpstreamProxy
from gateway.observability import logs, metrics
from gateway.observability.audit import Auditor
from gateway.pipeline.exchange import BODY_HOLD_LIMIT
from gateway.pipeline.gate import Gate
from gateway.runtime.admin_server import AdminServer
from gateway.runtime.lifecycle import Lifecycle
from gateway.runtime.memory import MemoryGuard
from gateway.runtime.mitmproxy_engine import MitmproxyEngine
from gateway.runtime.relay_link import RelayLink
from gateway.runtime.startup import FD_RESERVE, StartupError, bind
from gateway.runtime.sweeper import ConnectionSweeper
from gateway.services.approvals import ApprovalService
from gateway.services.dlp.detectors import SALT_FILE, LazyDetectors, ensure_salt
from gateway.services.identity.claims import TokenError
from gateway.services.identity.issued import IssuedTokens
from gateway.services.identity.keywatch import SigningKeyWatcher
from gateway.services.identity.signing_keys import SigningKeys
from gateway.services.identity.tokens import TokenService
from gateway.services.mcp_oauth import McpOAuthService
from gateway.services.metering import Metering, build_metering
from gateway.services.minting import TokenHttp
from gateway.services.policy import PolicyError, PolicyReloader
from gateway.services.secrets import SecretCache, SecretError, build_cache, build_store
from gateway.services.state.base import StateStore, StateUnavailable
from gateway.services.state.factory import build_state
from gateway.services.state.health import StoreHealth, unavailable_mode
from gateway.services.state.lease_keeper import slot_of
from gateway.services.state.log import BYTES_PER_LINE
from gateway.services.state.log_feed import RequestLog

if TYPE_CHECKING:
    from gateway.engines.dns import DnsServer
    from gateway.engines.mitm import Adapter
    from gateway.observability.otel_process import ExporterProcess
    from gateway.services.identity.kubernetes import PodIdentities

log = logging.getLogger("sandbox_gateway")

__all__ = ["Gateway", "StartupError", "bind"]


class Gateway(Lifecycle):
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
        self._loops: list[asyncio.Task[None]] = []  # run until stop() cancels them
        self.proxy: UpstreamProxy | None = None  # network.upstream_proxy
        self._vault_http: TokenHttp | None = None  # Key Vault's client (secrets.store)
        self.detectors: LazyDetectors | None = None  # policies' dlp: (services/dlp)
        self.mcp_oauth: McpOAuthService | None = None  # rules' mcp.oauth (services/mcp_oauth)

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

    async def start(self) -> None:
        """Start every part, in the order each needs the ones before it: the CA and the
        policies, identity (signing keys, the state store, tokens), the ports and the
        destination guard, the audit sink, the gate with the services it calls, then the
        engines on the ports and the admin API. A part that cannot start raises
        `StartupError` saying which and why."""
        # mitmproxy runs the loop with asyncio's eager task factory; set here, the loop
        # behaves the same before mitmproxy starts (on demand) as after.
        asyncio.get_running_loop().set_task_factory(asyncio.eager_task_factory)
        runtime, confdir = self._open_ca()
        keys = self._load_policies_and_keys()
        await self._open_identity(keys)
        sockets, admin_sock, overrides, shared = self._bind_ports()
        await self._open_audit()
        await self._build_gate(overrides, shared)
        await self._serve_engines(sockets, confdir, runtime, self._upstream_bundle(runtime))
        await self._serve_admin(admin_sock)

    def _open_ca(self) -> tuple[Path, Path]:
        """The dependencies' versions checked, the CA (and mitmproxy's view of it), the
        admin token; returns the runtime directory and mitmproxy's confdir."""
        cfg = self.config
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
        return runtime, confdir

    def _load_policies_and_keys(self) -> SigningKeys:
        """The policies (and the detectors they need), the signing keys."""
        cfg = self.config
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
        return keys

    async def _open_identity(self, keys: SigningKeys) -> None:
        """The state store and this process's lease in it, the token service, the
        supervisor's revocation relay, the record of issued tokens."""
        cfg = self.config
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

    async def _open_audit(self) -> None:
        """The audit sink (a previous run's spilled lines first), the console's request
        log and the OTLP exporter it feeds."""
        cfg = self.config
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

    async def _build_gate(self, overrides: dict[str, tuple[str, int]], shared: bool) -> None:
        """The services the gate calls (the upstream proxy, secrets, metering,
        credentials, pods, memory, ask mode, MCP OAuth), the gate, then what was granted
        before a restart and the DNS resolver."""
        cfg = self.config
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
            unpacking=self._unpacking(),
            max_connections=max(16, (self.fd_limit - FD_RESERVE - self.pool_limit) // 2),
            workloads=self.pods, approvals=self._build_approvals(overrides),
            pins=self._approvals().pins, state_health=self.state_health,
            capacity=self.memory, detectors=self.detectors,
            mcp_tokens=self._build_mcp_oauth(oauth_key))
        if self.otel is not None:  # (policies with telemetry: {content: true} export it)
            self.gate.parts.trail.content_sink = functools.partial(
                self.otel.feed.with_content, self.audit_write, logs.REDACTION.redact)
        # (the hosts whose requests carry the gateway's span: checked with the config)
        self.gate.parts.propagate = tuple(compile_host_pattern(host)
                                          for host in cfg.telemetry.propagate)
        # (the grants and tool pins that outlived a restart; then what is written anywhere)
        await self._approvals().start()
        await self._start_dns(shared)

    async def _serve_admin(self, admin_sock: socket.socket) -> None:
        """The admin API (bounded like the proxy's ports), mitmproxy when it serves the
        ports, and the loops that run until the stop; returns once every port listens."""
        cfg = self.config
        t = cfg.network.timeouts
        loop = asyncio.get_running_loop()
        assert self.mitmproxy is not None and self.memory is not None  # (made before)
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
        self.admin_server = AdminServer(UvicornConfig(
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
            self._loops.append(loop.create_task(self.proxy.watch(t.connect),
                                                name="upstream-proxy-probe"))
        self._loops.append(loop.create_task(self.memory.run(), name="memory"))
        # revoked tokens' and grants' connections end
        self.sweeper = ConnectionSweeper(self.gate, self.approvals)
        self.sweeper.start()
        self.key_watcher.start(self.tokens.use_keys)  # rotated keys sign without a restart
        logs.SOURCES.add(self._log_source, self._log_secrets)  # what logs must not show
        logs.protect()  # uvicorn's and mitmproxy's handlers too, now that they exist
        await self._wait_listening()
