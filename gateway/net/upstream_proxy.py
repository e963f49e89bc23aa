"""Dialling through the upstream (corporate) proxy: checks first, then the proxy.

Every engine dials a destination the gate has already resolved and checked (a
`Pinned`). With `network.upstream_proxy` set, `UpstreamProxy.open` connects to the
proxy instead, asks it to CONNECT to the checked address (`connect_to: address`, the
default; the name with `connect_to: name`) with the proxy's credentials (Basic, or
SOCKS5 username/password, from the gateway's secret store: never the sandbox's), and
hands the tunnel to the engine's protocol as if it were the direct connection: bytes
the proxy relayed past its answer are delivered first. The handshakes themselves are
`proxy_handshake.py`; this module only moves their bytes.

The proxy's own address is operator configuration: resolved by the system resolver
and dialled under `resolver.proxy_hop`, so the backstop (which refuses private
addresses to sandbox-chosen dials) lets exactly that one connection through.

A failure raises `ProxyDialFailed` (an `OSError`, so mitmproxy's dial reports it as
text; the text starts with `MARK`, a per-process nonce, so the mitmproxy adapter can
tell it from upstream words) carrying the `ProxyFailed` with its outcome and a
reason fit for the sandbox. Each dial counts one outcome in
`sandbox_gateway_upstream_proxy_connects_total{outcome}`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from gateway.core.addresses import Pinned
from gateway.core.secret_value import SecretValue
from gateway.net.proxy_handshake import HttpConnect, ProxyFailed, Socks5Connect
from gateway.net.proxy_settings import ProxySettings
from gateway.net.resolver import SystemResolver, proxy_hop
from gateway.observability import metrics

__all__ = ["MARK", "ProxyDialFailed", "UpstreamProxy", "dialer"]

log = logging.getLogger("sandbox_gateway")

MARK = f"upstream proxy [{secrets.token_hex(6)}]: "
P = TypeVar("P", bound=asyncio.BaseProtocol)
SecretGetter = Callable[[str], Awaitable[SecretValue]]
Machine = HttpConnect | Socks5Connect


class ProxyDialFailed(ConnectionError):
    """A dial through the upstream proxy failed (see the module docstring)."""

    def __init__(self, failure: ProxyFailed) -> None:
        super().__init__(MARK + failure.reason)
        self.failure = failure


class _Handshake(asyncio.Protocol):
    """The connection's protocol while the handshake runs."""

    def __init__(self, machine: Machine) -> None:
        self.machine = machine
        self.transport: asyncio.Transport | None = None
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.extra = bytearray()  # bytes that arrived after the handshake ended

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.finished.done():
            self.extra += data
            return
        try:
            out = self.machine.feed(data)
        except ProxyFailed as failure:
            self.finished.set_exception(failure)
            return
        if out and self.transport is not None:
            self.transport.write(out)
        if self.machine.done:
            if self.transport is not None:
                self.transport.pause_reading()  # the engine's protocol reads on
            self.finished.set_result(None)

    def eof_received(self) -> bool | None:
        self._fail(ProxyFailed("refused", "the upstream proxy closed the connection "
                               "during the CONNECT handshake"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ProxyFailed("refused", "the upstream proxy closed the connection "
                               "during the CONNECT handshake"))

    def _fail(self, failure: ProxyFailed) -> None:
        if not self.finished.done():
            self.finished.set_exception(failure)


def _deliver(protocol: asyncio.BaseProtocol, data: bytes) -> None:
    """Hand `data` to a protocol as if the transport had read it."""
    if isinstance(protocol, asyncio.BufferedProtocol):
        view = memoryview(data)
        while view:
            buf = memoryview(protocol.get_buffer(len(view)))
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            protocol.buffer_updated(n)
            view = view[n:]
    elif isinstance(protocol, asyncio.Protocol):
        protocol.data_received(data)


class UpstreamProxy:
    """One configured upstream proxy (see the module docstring)."""

    def __init__(self, settings: ProxySettings, *, secret: SecretGetter | None = None,
                 tls: ssl.SSLContext | None = None,
                 resolve: Callable[[str, int], Awaitable[list[str]]] | None = None) -> None:
        self.settings = settings
        self._secret = secret
        self._tls = tls if settings.scheme == "https" else None
        if settings.scheme == "https" and self._tls is None:
            self._tls = ssl.create_default_context()
        self._resolve = resolve or SystemResolver().resolve
        self.problem: str | None = None  # the readiness probe's last finding (check_ready)

    def applies(self, host: str, ip: str | None, port: int) -> bool:
        """Whether a dial to host (at ip):port goes through the proxy (no_proxy: not)."""
        return not self.settings.no_proxy.matches(host, ip, port)

    def target(self, pinned: Pinned) -> tuple[str, int]:
        """What the proxy is asked to connect to for `pinned`."""
        if self.settings.connect_to == "name":
            return pinned.host, pinned.port
        return pinned.address

    async def credentials(self) -> SecretValue | None:
        settings = self.settings
        if settings.userinfo is not None:
            return settings.userinfo
        if settings.credentials is None:
            return None
        if self._secret is None:
            raise ProxyFailed("credentials_unavailable", "the upstream proxy's credentials "
                              "cannot be read: no secret store")
        try:
            return await self._secret(settings.credentials)
        except Exception as exc:  # (SecretUnavailable and the stores' own errors)
            log.warning("upstream proxy: credentials secret %r unavailable: %s",
                        settings.credentials, type(exc).__name__)
            raise ProxyFailed("credentials_unavailable", "the upstream proxy's credentials "
                              "(network.upstream_proxy.credentials) could not be read from "
                              "the secret store") from None

    async def open(self, pinned: Pinned, factory: Callable[[], P], *, timeout: float,
                   tls: ssl.SSLContext | None = None, server_hostname: str | None = None,
                   ) -> tuple[asyncio.Transport, P]:
        """A connection to `pinned` through the proxy, its protocol made by `factory`;
        with `tls`, TLS to the destination is completed first (the gateway's own calls).
        The whole dial (proxy TCP, proxy TLS, CONNECT answer, destination TLS) within
        `timeout`."""
        host, port = self.target(pinned)
        transport: asyncio.Transport | None = None
        try:
            try:
                async with asyncio.timeout(timeout):
                    machine: Machine = (Socks5Connect if self.settings.socks else HttpConnect)(
                        host, port, await self.credentials())
                    transport, handshake = await self._connect(machine)
                    await handshake.finished
                    leftover = machine.leftover + bytes(handshake.extra)
                    if tls is not None:
                        if leftover:
                            raise ProxyFailed("protocol_error", "the upstream proxy sent data "
                                              "before the TLS handshake")
                        loop = asyncio.get_running_loop()
                        upgraded = await loop.start_tls(transport, handshake, tls,
                                                        server_hostname=server_hostname)
                        assert isinstance(upgraded, asyncio.Transport)
                        transport = upgraded
            except TimeoutError:
                raise ProxyFailed("timeout", f"no tunnel through the upstream proxy within "
                                  f"{timeout:g}s (network.timeouts.connect)") from None
            except OSError as exc:
                if transport is not None:
                    raise  # (TLS to the destination, past the proxy: the destination's)
                if isinstance(exc, ssl.SSLError):
                    raise ProxyFailed("tls", "the upstream proxy's TLS certificate could "
                                      "not be verified (the gateway trusts the public roots "
                                      "and network.upstream_ca)") from None
                raise ProxyFailed("unreachable", "the upstream proxy could not be reached "
                                  f"({exc.strerror or type(exc).__name__})") from None
        except ProxyFailed as failure:
            if transport is not None:
                transport.abort()
            metrics.child(metrics.UPSTREAM_PROXY_CONNECTS, failure.outcome).inc()
            log.info("upstream proxy %s: CONNECT %s:%s for %s failed: %s",
                     self.settings.where, host, port, pinned.host, failure.reason)
            raise ProxyDialFailed(failure) from None
        except BaseException:
            if transport is not None:
                transport.abort()
            metrics.child(metrics.UPSTREAM_PROXY_CONNECTS, "error").inc()
            raise
        metrics.child(metrics.UPSTREAM_PROXY_CONNECTS, "ok").inc()
        protocol = factory()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if leftover:
            _deliver(protocol, leftover)
        if not transport.is_closing():
            transport.resume_reading()
        return transport, protocol

    async def _connect(self, machine: Machine | None) -> tuple[asyncio.Transport, _Handshake]:
        """TCP (and with https://, TLS) to the proxy, the handshake's first bytes sent
        (none without `machine`: the readiness probe)."""
        settings = self.settings
        loop = asyncio.get_running_loop()
        ips = await self._resolve(settings.host, settings.port)
        last: OSError = OSError("no addresses")
        first = machine or HttpConnect("", 0, None)
        for ip in ips:
            try:
                with proxy_hop(ip, settings.port):
                    transport, handshake = await loop.create_connection(
                        lambda: _Handshake(first), ip, settings.port, ssl=self._tls,
                        server_hostname=settings.host if self._tls is not None else None)
            except OSError as exc:
                last = exc
                continue
            assert isinstance(transport, asyncio.Transport)
            if machine is not None:
                transport.write(machine.start())
            return transport, handshake
        raise last

    async def probe(self, timeout: float) -> str | None:
        """Whether the proxy accepts a connection (TCP, and TLS for https://) within
        `timeout`: None, or what is wrong (for `/readyz` with check_ready)."""
        try:
            async with asyncio.timeout(timeout):
                transport, _ = await self._connect(None)
            transport.abort()
        except TimeoutError:
            return f"the upstream proxy {self.settings.where} did not accept a connection " \
                   f"within {timeout:g}s"
        except OSError as exc:
            return f"the upstream proxy {self.settings.where} cannot be reached " \
                   f"({exc.strerror or type(exc).__name__})"
        return None

    async def watch(self, timeout: float, every: float = 5.0) -> None:
        """Probe forever (a task, with check_ready), keeping `problem` current."""
        while True:
            problem = await self.probe(timeout)
            if problem != self.problem:
                (log.warning if problem else log.info)(
                    "upstream proxy: %s", problem or f"{self.settings.where} reachable again")
            self.problem = problem
            await asyncio.sleep(every)


def dialer(proxy: UpstreamProxy, pinned: Pinned, timeout: float
           ) -> Callable[[Any, Callable[[], Any]], Awaitable[tuple[asyncio.Transport, Any]]]:
    """For the event loop's pinned-dial route (mitmproxy's dials): `(loop, factory)` to
    the proxied connection."""
    async def dial(loop: Any, factory: Callable[[], Any]) -> tuple[asyncio.Transport, Any]:
        return await proxy.open(pinned, factory, timeout=timeout)

    return dial

