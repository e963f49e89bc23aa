"""The gateway's listeners: the policy-aware DNS resolver, mitmproxy's master with the
gateway's adapter (on the ports' sockets, or taking the doors' servers), the
addresses they listen on, and closing them."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.core.phrases import error_phrase
from gateway.engines import patches
from gateway.observability import logs, metrics
from gateway.runtime.parts import GatewayParts
from gateway.runtime.startup import StartupError

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
