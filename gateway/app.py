"""Wire the gateway: mitmproxy Master with a minimal addon chain + Starlette admin API.

One process, one event loop: mitmproxy's proxy server and uvicorn's admin server
run side by side. `ADDON_ORDER` below *is* the data flow of every request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import certifi
import uvicorn
from mitmproxy import options
from mitmproxy.addons import core, proxyserver, tlsconfig
from mitmproxy.master import Master

from gateway import ca, metrics
from gateway.addons.common import Sessions
from gateway.addons.destination import Destinations
from gateway.addons.enforce import Enforce
from gateway.addons.identify import Identify
from gateway.addons.idle import IdleUpstreams
from gateway.addons.inject import Inject
from gateway.addons.layers import SelectLayer
from gateway.addons.local_api import LocalApi
from gateway.addons.record import Record
from gateway.addons.transparent import Transparent
from gateway.api.admin import AdminContext, build_admin_app
from gateway.audit import Auditor
from gateway.config import Config, HostPort
from gateway.destination import AddressPolicy
from gateway.dns import DnsServer, start_dns
from gateway.fastpath import FastPath
from gateway.intercept import Engine, Hooks
from gateway.listeners import BACKLOG
from gateway.listeners import install as install_listeners
from gateway.policy import Policy, PolicyError, PolicyReloader, PolicySet
from gateway.resolver import (
    DestinationGuard,
    Resolver,
    SystemResolver,
    install_backstop,
    local_interface_addresses,
    parse_overrides,
)
from gateway.secrets import SecretCache, SecretError, build_cache, build_store
from gateway.state import StateStore, StateUnavailable, build_state
from gateway.tls_memory import LeafContexts, upstream_context
from gateway.tokens import SigningKeys, TokenService
from gateway.upstream_errors import install as install_error_pages

log = logging.getLogger("sandbox_gateway")


class StartupError(RuntimeError):
    """The gateway cannot start; the message says what to fix."""


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handling: the gateway owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(hp: HostPort, shared: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in hp.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((hp.host, hp.port))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {hp}: {exc.strerror}") from None
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock


class Gateway:
    """The running gateway. `start()` binds everything; `stop()` shuts it down cleanly."""

    def __init__(self, config: Config, *, resolver: Resolver | None = None,
                 audit_stream: IO[str] | None = None, state: StateStore | None = None,
                 worker: int | None = None) -> None:
        self.config = config
        self.worker = worker  # index among worker processes sharing the ports, or None
        self.resolver = resolver or SystemResolver()
        self.audit_stream = audit_stream
        self._state = state
        self.master: Master | None = None
        self.admin_server: uvicorn.Server | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.proxy_address: tuple[str, int] | None = None
        self.admin_address: tuple[str, int] | None = None
        self.admin_token = ""
        self.admin_token_created = False
        self.policy_set: PolicySet | None = None
        self._listening = False
        self.dns: DnsServer | None = None

    # -- state the addons read -----------------------------------------------------------

    def policy(self, name: str) -> Policy | None:
        return self.policy_set.get(name) if self.policy_set is not None else None

    def policy_credentials(self, name: str) -> list[str] | None:
        """Credential names policy `name` references; None if there is no such policy."""
        policy = self.policy(name)
        return None if policy is None else policy.credential_names

    def current_policies(self) -> PolicySet:
        assert self.policy_set is not None
        return self.policy_set

    def ready(self) -> tuple[bool, str]:
        if self.policy_set is None:
            return False, "policies not loaded"
        if not self._listening:
            return False, "proxy listener not up"
        return True, "ready"

    def _on_reload(self, policy_set: PolicySet) -> None:
        self.policy_set = policy_set
        log.info("policies loaded: %d policies, %d rules",
                 len(policy_set.policies), policy_set.rule_count)

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

        self.reloader = PolicyReloader(cfg.policies, on_reload=self._on_reload)
        try:
            self.policy_set = self.reloader.load_now()
        except PolicyError as exc:
            raise StartupError(f"policies in {cfg.policies} are invalid:\n"
                               + "\n".join(exc.errors)) from None
        keys = SigningKeys.load(cfg.signing_dir, retired=cfg.tokens.retired_kids)
        try:
            self.state: StateStore = self._state or build_state(cfg.state)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        try:
            await self.state.start()
        except StateUnavailable as exc:
            raise StartupError(f"state store: {exc}") from None
        self.tokens = TokenService(
            keys, self.state, self.policy_credentials,
            issuer=cfg.tokens.issuer, default_ttl=cfg.tokens.default_ttl,
            max_ttl=cfg.tokens.max_ttl, max_lifetime=cfg.tokens.max_lifetime,
            leeway=cfg.tokens.leeway,
        )

        shared = self.worker is not None
        if shared:
            # Workers bind the ports the supervisor reserved, with SO_REUSEPORT.
            self.proxy_address = (cfg.listen.proxy.host, cfg.listen.proxy.port)
        else:
            proxy_sock = _bind(cfg.listen.proxy)
            self.proxy_address = proxy_sock.getsockname()[:2]
            # mitmproxy binds its own listener: free our reservation right before it does.
            proxy_sock.close()
        admin_sock = _bind(cfg.listen.admin, shared=shared)
        self.admin_address = admin_sock.getsockname()[:2]

        self.address_policy = AddressPolicy(
            allow_cidrs=cfg.network.allow_cidrs, deny_cidrs=cfg.network.deny_cidrs,
            own_addresses=[self.proxy_address, self.admin_address],
            local_addresses=local_interface_addresses(),
        )
        try:
            overrides = parse_overrides(cfg.network.resolve)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        self.guard = DestinationGuard(self.address_policy, self.resolver, overrides=overrides)
        install_backstop(self.address_policy, everywhere=False)
        self.auditor = Auditor(cfg.audit_path, self.audit_stream, worker=self.worker)
        try:
            self.secrets: SecretCache = build_cache(build_store(cfg.secrets), cfg.secrets)
        except (ValueError, SecretError) as exc:
            raise StartupError(str(exc)) from None
        await self._start_dns(shared)
        install_error_pages()
        self.fast = FastPath(self.tokens, self.policy, self.guard, self.auditor)
        install_listeners(self.fast, shared=self.worker is not None)
        bundle = self._upstream_bundle(runtime)
        self.master = self._build_master(confdir, bundle)
        if cfg.network.intercept == "fast":
            self.leaves = LeafContexts(self.master.addons.get("tlsconfig").certstore, runtime)
            # IdleUpstreams closes mitmproxy's connections; the intercept path its own.
            hooks = Hooks(self.master.addons, skip=(IdleUpstreams,))
            self.fast.engine = Engine(hooks, self.sessions, self.leaves,
                                      upstream_context(bundle),
                                      cfg.network.upstream_idle_timeout)

        app = build_admin_app(AdminContext(
            admin_token=self.admin_token, tokens=self.tokens,
            policies=self.current_policies, readiness=self,
        ))
        self.admin_server = _QuietServer(uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off"))
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self.master.run(), name="mitmproxy"))
        self._tasks.append(loop.create_task(self.admin_server.serve(sockets=[admin_sock]),
                                            name="admin"))
        self.reloader.start()
        await self._wait_listening()

    # -- the DNS resolver (gateway/dns/), kept apart from the proxy wiring ------------------

    async def _start_dns(self, shared: bool) -> None:
        """Start the policy-aware DNS resolver when `listen.dns` is set."""
        try:
            self.dns = await start_dns(self.config, self.state, self.policy, self.guard,
                                       self.auditor, shared=shared)
        except OSError as exc:
            raise StartupError(f"cannot listen on listen.dns {self.config.listen.dns}: "
                               f"{exc.strerror or exc}") from None

    async def _stop_dns(self) -> None:
        if self.dns is not None:
            await self.dns.close()

    def _build_master(self, confdir: Path, upstream_bundle: Path) -> Master:
        opts = options.Options()
        master = Master(opts, event_loop=asyncio.get_running_loop())
        self.sessions = Sessions()
        master.addons.add(
            core.Core(),
            proxyserver.Proxyserver(),
            tlsconfig.TlsConfig(),
            # No errorcheck.ErrorCheck: the gateway validates its own startup, and
            # ErrorCheck exits on *any* error logged process-wide during startup.
            # The data flow, in order:
            Identify(self.tokens, self.sessions, self.auditor, self.state),
            Enforce(self.policy, self.sessions, self.auditor),
            LocalApi(self.tokens),
            Destinations(self.guard, self.sessions, self.auditor),
            Inject(self.tokens, self.secrets, self.current_policies, self.auditor),
            Transparent(self.policy, self.guard, self.state, self.sessions, self.auditor),
            SelectLayer(self.sessions),
            Record(self.sessions, self.auditor),
            IdleUpstreams(self.config.network.upstream_idle_timeout),
        )
        assert self.proxy_address is not None
        host, port = self.proxy_address
        modes = [f"regular@{host}:{port}"]
        if self.config.listen.transparent is not None:
            modes.append(f"transparent@{self.config.listen.transparent}")
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
            stream_large_bodies="1m",
            store_streamed_bodies=False,
        )
        return master

    async def _wait_listening(self) -> None:
        assert self.master is not None
        ps = self.master.addons.get("proxyserver")
        for _ in range(500):
            if all(s.is_running for s in ps.servers) and self.admin_server is not None \
                    and self.admin_server.started:
                for server in ps.servers:
                    self.address_policy.add_own_addresses(server.listen_addrs)
                self._listening = True
                metrics.POLICY_RULES.set(self.current_policies().rule_count)
                return
            for task in self._tasks:
                if task.done():
                    exc = task.exception()
                    raise StartupError(f"{task.get_name()} failed to start: {exc}")
            await asyncio.sleep(0.01)
        raise StartupError("listeners did not come up within 5 s")

    async def stop(self) -> None:
        self._listening = False
        if self.admin_server is not None:
            self.admin_server.should_exit = True
        if self.master is not None:
            # Close the proxy listeners (mitmproxy's Done hook leaves them open) and the
            # tunnels the fast path splices.
            await self.master.addons.get("proxyserver").servers.update([])
            self.fast.close_all()
            self.master.shutdown()
        await self._stop_dns()
        await self.reloader.stop()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, timeout=5)
        self._tasks.clear()
        await self.state.close()
        await self.secrets.close()
        self.auditor.close()
        if self.fast.engine is not None:
            self.leaves.close()
        if self._tmp is not None:
            self._tmp.cleanup()
