"""The splice: passthrough tunnels relayed byte for byte, and ended when they are done.

A tunnel the gate admitted without inspection (a host-only rule, or `protocol: tcp`)
is relayed between two asyncio transports: no per-chunk events, no parsing. The
upstream side reads into a reusable buffer that starts small (idle tunnels stay cheap)
and grows while reads fill it. Both directions are counted for the audit line.

A tunnel ends — both sockets closed, one audit line written, the gauge counted down —
when both directions have sent EOF, when either side fails, when it carries nothing
for `network.timeouts.client_idle`, when it outlives `limits.max_tunnel_lifetime`, or
when its token expires or is revoked (the gate's sweep, gateway/runtime/sweeper.py, ends every
engine's connections whose identity no longer holds).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

from gateway.core.addresses import Pinned
from gateway.engines.relay_native import AVAILABLE as NATIVE
from gateway.engines.relay_native import NativeRelay, Relays
from gateway.engines.splice_kernel import AVAILABLE as KERNEL
from gateway.engines.splice_kernel import KernelRelay, Pipes
from gateway.net.resolver import pin
from gateway.net.upstream_proxy import ProxyDialFailed, UpstreamProxy
from gateway.pipeline.gate import Client, Gate

log = logging.getLogger("sandbox_gateway")

HIGH_WATER = 1024 * 1024
READ_SIZE = 256 * 1024
FIRST_READ_SIZE = 16 * 1024


class Splices:
    """Every open splice, and the one sweeper that ends idle and overlong ones."""

    def __init__(self, gate: Gate, *, idle: float, lifetime: float, connect: float,
                 proxy: UpstreamProxy | None = None) -> None:
        self.gate = gate
        self.proxy = proxy  # network.upstream_proxy: dial through it
        self.idle = idle
        self.lifetime = lifetime
        self.connect = connect
        self.open: set[Splice] = set()
        self.pipes = Pipes()  # the kernel relays' (splice_kernel)
        # the native relay thread's (relay_native), where the extension is built
        self.relays = Relays() if NATIVE else None
        self._sweeper: asyncio.Task[None] | None = None

    def start(self, transport: asyncio.Transport, client: Client, first: bytes) -> Splice:
        """Splice `transport` (already answered) to the client's pinned tunnel address."""
        splice = Splice(self, client)
        client.engine = "splice"
        self.open.add(splice)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        splice.take(transport, first)
        return splice

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for splice in list(self.open):
                try:
                    reason = splice.overdue(now)
                    if reason is not None:
                        log.info("closing tunnel from %s to %s: %s", splice.client.peer,
                                 splice.where, reason)
                        splice.close(reason)
                except Exception:
                    log.exception("sweeping a tunnel failed; closing it")
                    splice.close("gateway_error")

    def close_all(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for splice in list(self.open):
            splice.close("shutting_down")
        self.pipes.clear()
        if self.relays is not None:
            self.relays.stop()


class Splice(asyncio.Protocol):
    """The sandbox side of one spliced tunnel (the transport's protocol)."""

    def __init__(self, owner: Splices, client: Client) -> None:
        self.owner = owner
        self.client = client
        tunnel = client.tunnel
        assert tunnel is not None and tunnel.pinned is not None
        self.pinned: Pinned = tunnel.pinned
        self.where = f"{tunnel.host}:{tunnel.port}"
        self.transport: asyncio.Transport | None = None
        self.peer: _Upstream | None = None
        self.pending = bytearray()  # client bytes before the upstream is connected
        self.bytes_out = 0
        self.client_ended = False
        self.upstream_ended = False
        self.started = time.monotonic()
        self.last = self.started
        self.error: str | None = None
        self.finished = False
        self._raw: socket.socket | None = None  # the upstream socket while it has no owner
        self.relay: KernelRelay | NativeRelay | None = None

    def take(self, transport: asyncio.Transport, first: bytes) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=HIGH_WATER)
        transport.set_protocol(self)
        asyncio.get_running_loop().create_task(self._dial())
        if first:
            self.data_received(first)
        transport.resume_reading()

    def overdue(self, now: float) -> str | None:
        """Why the sweeper should end this tunnel now, or None."""
        last = self.last if self.relay is None else max(self.last, self.relay.last)
        if self.owner.idle > 0 and now - last > self.owner.idle:
            return "idle_timeout"
        if self.owner.lifetime > 0 and now - self.started > self.owner.lifetime:
            return "max_tunnel_lifetime"
        return None

    async def _dial(self) -> None:
        ip, port = self.pinned.address
        loop = asyncio.get_running_loop()
        try:
            pin(self.pinned)  # the address we connect to is the one that was checked
            proxy = self.owner.proxy
            if proxy is not None and proxy.applies(self.pinned.host, ip, self.pinned.port):
                _, upstream = await proxy.open(self.pinned, lambda: _Upstream(self),
                                               timeout=self.owner.connect)
            else:
                async with asyncio.timeout(self.owner.connect):
                    self._raw = await _connect(loop, ip, port)
                if self._to_kernel(self._raw):
                    return
                _, upstream = await loop.create_connection(lambda: _Upstream(self),
                                                           sock=self._raw)
                self._raw = None
        except ProxyDialFailed as exc:  # (logged by the proxy's dial)
            log.info("passthrough to %s: %s", self.where, exc.failure.reason)
            self.close("upstream_proxy_failed")
            return
        except (OSError, TimeoutError) as exc:
            log.info("passthrough to %s (%s) failed: %s", self.where, ip,
                     f"no TCP connection within {self.owner.connect:g}s "
                     "(network.timeouts.connect)" if isinstance(exc, TimeoutError)
                     else exc.strerror or type(exc).__name__)
            self.close("upstream_failed")
            return
        except Exception:
            log.exception("passthrough dial failed; closing (fail closed)")
            self.close("gateway_error")
            return
        self.peer = upstream
        if self.transport is None or self.transport.is_closing():
            upstream.close()
            return
        if self.pending:
            upstream.write(bytes(self.pending))
            self.pending.clear()
            self.transport.resume_reading()
        if self.client_ended:
            self._half_close_upstream()

    def _to_kernel(self, upstream: socket.socket) -> bool:
        """Hand a direct tunnel to the native relay thread (`relay_native`), or where it
        is not built to the loop's kernel relay (`splice_kernel`): when the client's
        transport is a plain socket whose answer (the door's 200) is all sent. What the
        client sent meanwhile goes first (all of it at once, else the transports' way);
        then the relay takes a copy of the client's descriptor and the transport is
        dropped. False: relay through transports."""
        transport = self.transport
        if not KERNEL or transport is None or transport.is_closing() \
                or transport.get_extra_info("sslcontext") is not None \
                or transport.get_write_buffer_size():
            return False
        wrapped = transport.get_extra_info("socket")
        if wrapped is None or wrapped.type != socket.SOCK_STREAM:
            return False
        transport.pause_reading()
        if self.pending:
            try:
                sent = upstream.send(self.pending)
            except BlockingIOError:
                sent = 0
            del self.pending[:sent]
            if self.pending:
                transport.resume_reading()
                return False
        try:
            client = wrapped.dup()
        except OSError:
            transport.resume_reading()
            return False
        relays = self.owner.relays
        relay: KernelRelay | NativeRelay = (
            relays.relay(client, upstream, lambda: self.close(None)) if relays is not None
            else KernelRelay(client, upstream, self.owner.pipes, lambda: self.close(None)))
        self._raw = None
        self.relay = relay
        # The transport gives up its descriptor (the relay's copy is the connection now):
        # a tunnel holds two, as the connection cap derived from the descriptor limit
        # counts (runtime: limits); the sweep's `end` ends the relay instead.
        transport.set_protocol(asyncio.Protocol())
        # (its write buffer is empty, checked above: `close` ends it as `abort` would, and
        # also drops the transport's callbacks to itself, a cycle `abort` leaves)
        transport.close()
        self.transport = None
        self.client.end = self._end
        relay.start(client_ended=self.client_ended)
        return True

    def _end(self) -> None:
        """The gate's sweep ends a kernel-relayed tunnel (revoked, expired)."""
        self.close(None)

    # -- relaying ------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        self.last = time.monotonic()
        self.bytes_out += len(data)
        peer = self.peer
        if peer is None or peer.transport is None:
            self.pending += data
            if len(self.pending) > HIGH_WATER and self.transport is not None:
                self.transport.pause_reading()  # resumed once the upstream is connected
            return
        peer.write(data)

    def pause_writing(self) -> None:
        if self.peer is not None:
            self.peer.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None:
            self.peer.resume_reading()

    def eof_received(self) -> bool | None:
        """The sandbox finished sending: pass the EOF on and keep reading the upstream's
        answer; once the upstream has ended too, the tunnel is over."""
        self.client_ended = True
        if self.upstream_ended:
            self.close(None)
            return True
        if self.peer is not None and self.peer.transport is not None:
            self._half_close_upstream()
        return True  # a dial under way forwards the EOF when it is connected

    def _half_close_upstream(self) -> None:
        assert self.peer is not None and self.peer.transport is not None
        if self.peer.transport.can_write_eof():
            self.peer.transport.write_eof()
        else:
            self.close(None)

    def upstream_eof(self) -> bool:
        self.upstream_ended = True
        self.last = time.monotonic()
        transport = self.transport
        if self.client_ended or transport is None or not transport.can_write_eof():
            self.close(None)
            return False
        transport.write_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.close(None)

    def close(self, error: str | None) -> None:
        """End the tunnel: both sockets closed, audited once, counted down."""
        if self.error is None:
            self.error = error
        if self.transport is not None:
            self.transport.close()
        if self.peer is not None:
            self.peer.close()
        if self.relay is not None:
            self.relay.close()
        if self._raw is not None:
            self._raw.close()
            self._raw = None
        if self.finished:
            return
        self.finished = True
        self.owner.open.discard(self)
        if not self.owner.open:
            self.owner.pipes.clear()
        relay = self.relay
        bytes_in = self.peer.bytes_in if self.peer is not None else 0
        bytes_out = self.bytes_out
        if relay is not None:
            bytes_in, bytes_out = relay.bytes_in, bytes_out + relay.bytes_out
        # (no reference cycles left: the relay's callback and the client's `end` point back
        # here, and would keep the tunnel's objects until a garbage collection)
        self.relay = None
        if self.client.end == self._end:
            self.client.end = None
        try:
            self.owner.gate.tunnel_closed(self.client, bytes_in, bytes_out, self.error)
        finally:
            self.owner.gate.closed(self.client)


async def _connect(loop: asyncio.AbstractEventLoop, ip: str, port: int) -> socket.socket:
    """A non-blocking TCP socket connected to `ip:port` (through the loop's guarded
    `sock_connect`, as `create_connection` dials), TCP_NODELAY like asyncio's transports."""
    sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await loop.sock_connect(sock, (ip, port))
    except BaseException:
        sock.close()
        raise
    return sock


class _Upstream(asyncio.BufferedProtocol):
    """The upstream side: reads into a reusable buffer (no allocation per read) that
    starts small and grows while reads fill it; a buffer the client transport still
    holds (a write it could not finish) is never reused."""

    def __init__(self, front: Splice) -> None:
        self.front = front
        self.transport: asyncio.Transport | None = None
        self.bytes_in = 0
        self._buffer = bytearray(FIRST_READ_SIZE)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.set_write_buffer_limits(high=HIGH_WATER)
        self.transport = transport

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def pause_reading(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self._buffer)

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_in += nbytes
        self.front.last = time.monotonic()
        client = self.front.transport
        if client is None:
            return
        client.write(memoryview(self._buffer)[:nbytes])
        size = len(self._buffer)
        if nbytes == size and size < READ_SIZE:
            self._buffer = bytearray(min(size * 4, READ_SIZE))  # a bulk transfer: read more
        elif client.get_write_buffer_size():
            self._buffer = bytearray(size)  # the old one is queued in the transport

    def pause_writing(self) -> None:
        if self.front.transport is not None:
            self.front.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.front.transport is not None:
            self.front.transport.resume_reading()

    def eof_received(self) -> bool | None:
        return self.front.upstream_eof()

    def connection_lost(self, exc: Exception | None) -> None:
        self.front.close(None)
