"""The gateway's listeners: the ports bound (with the destination guard over the addresses
they leave), the doors and engines serving them, the policy-aware DNS resolver,
mitmproxy's master with the gateway's adapter (on the ports' sockets, or taking the doors'
servers), the addresses they listen on, and closing them."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.core.addresses import AddressPolicy
from gateway.core.phrases import error_phrase
from gateway.engines import patches
from gateway.engines.door import Doors
from gateway.engines.frontdoor import FrontDoor
from gateway.engines.h1.pool import LIMIT as POOL_LIMIT
from gateway.engines.h1.server import Engine, Limits, Timeouts
from gateway.engines.splice import Splices
from gateway.engines.transparent import TransparentDoor
from gateway.net.resolver import (
    DestinationGuard,
    install_backstop,
    local_interface_addresses,
    parse_overrides,
)
from gateway.net.roots import public_roots
from gateway.net.tls import LeafContexts, upstream_context
from gateway.observability import logs, metrics
from gateway.runtime.mitmproxy_engine import MitmproxyEngine
from gateway.runtime.parts import GatewayParts
from gateway.runtime.startup import FD_RESERVE, StartupError, bind, raise_fd_limit

if TYPE_CHECKING:
    from mitmproxy.master import Master


__all__ = ["Listening"]


class Listening(GatewayParts):
    """The listeners of a gateway: the DNS resolver, mitmproxy's master, the ports."""

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
        from gateway.engines.mitm import (
            STREAM_LARGE_BODIES,
            Adapter,
            error_h2,
            error_page,
            handshake_error,
        )

        patches.install_error_pages(error_page, error_h2)
        patches.install_h1_framing()
        patches.install_stream_refusal()
        patches.install_head_refusal()
        patches.install_error_sides()
        patches.install_ticket_hold()
        patches.install_upstream_timeouts(handshake_error)
        patches.install_log_hygiene(error_phrase)
        patches.install_listeners(sockets=sockets, servers=servers)

        opts = options.Options()
        timeouts = self.config.network.timeouts
        patches.add_handshake_option(opts, timeouts.handshake)
        master = Master(opts, event_loop=asyncio.get_running_loop())
        self.adapter = Adapter(self.gate, self.handoffs, proxy=self.proxy,
                               connect_timeout=timeouts.connect,
                               read_timeout=timeouts.read)
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

    def _bind_ports(self) -> tuple[dict[tuple[str, int], socket.socket], socket.socket,
                                   dict[str, tuple[str, int]], bool]:
        """The open-files limit and the connection budget, the ports bound, the
        destination guard (and the loop's backstop) over the addresses they leave.
        Returns the proxy ports' sockets, the admin socket, `network.resolve`'s
        overrides, and whether the ports are shared with other workers."""
        cfg = self.config
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
        return sockets, admin_sock, overrides, shared

    async def _serve_engines(self, sockets: dict[tuple[str, int], socket.socket],
                             confdir: Path, runtime: Path, bundle: Path) -> None:
        """The doors and engines on the ports (`network.intercept: fast`), or mitmproxy
        serving them (`bundle`: the roots it verifies upstreams with)."""
        cfg = self.config
        t = cfg.network.timeouts
        timeouts = Timeouts(connect=t.connect, read=t.read, client_idle=t.client_idle,
                            handshake=t.handshake)
        limits = Limits(max_header_bytes=cfg.limits.max_header_bytes,
                        max_websocket_message=cfg.limits.max_websocket_message)
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
