"""One side of an HTTP/1 exchange: a transport, optionally TLS, and its receive buffer.

The serving coroutine reads plaintext from `buf` (h11's receive buffer) and awaits
`more()`; the protocol callbacks fill it. While a Content-Length body is read
(`expect`), what arrives of it with nothing before it in `buf` is kept as it came
(`chunks`) instead: a large body is handed on without being copied into the buffer
and out again (that copy was the largest single cost of a bulk download). Writes are
gathered and encrypted together when the coroutine is about to wait (a small exchange
costs one TLS record and one write per direction) or once 64 KiB are pending, and
honour the transport's flow control. Every wait has a deadline: the engine's sweeper
(one timer for all connections) fails a wait past its deadline with `TimeoutError`
naming what was waited for (`more(timeout, phase)`), so no per-wait timer is armed on
the hot path.
"""

from __future__ import annotations

import asyncio
import copy
import ssl
import time

from gateway.core.addresses import Pinned
from gateway.engines.patches import ReceiveBuffer
from gateway.net.resolver import pin
from gateway.net.tls import TlsClosed, TlsPump
from gateway.net.upstream_proxy import UpstreamProxy

HIGH_WATER = 1024 * 1024
OUT_LIMIT = 64 * 1024


class Side(asyncio.Protocol):
    """See the module docstring."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.tls: TlsPump | None = None
        self.buf = ReceiveBuffer()
        self.eof = False
        self.lost = False
        self.error: BaseException | None = None
        self.received = 0  # bytes of plaintext received in all (progress for retries)
        self._waiter: asyncio.Future[None] | None = None
        self.deadline = 0.0  # monotonic; the sweeper fails a wait past it
        self.waiting = ""  # what the current wait is for (named by its TimeoutError)
        self._drain: asyncio.Future[None] | None = None
        self._paused = False
        self._out: list[bytes | memoryview] = []
        self._out_size = 0
        self.partner: Side | None = None  # the other side (its writes flush with ours)
        # body bytes that came after all of `buf` (`expect`)
        self.chunks: list[bytes | bytearray] = []
        self._chunked = 0  # their size
        self._expected = 0  # bytes of the body being read not received yet

    # transport events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=HIGH_WATER)

    def data_received(self, received: bytes) -> None:
        data: bytes | bytearray = received
        if self.tls is not None:
            try:
                data = self.tls.feed(received)
            except (TlsClosed, ssl.SSLError) as exc:
                self._end(exc)
                return
        if data:
            size = len(data)
            self.received += size
            if self._expected:
                if size <= self._expected and not len(self.buf):
                    self.chunks.append(data)  # (kept as it came: no copy)
                    self._chunked += size
                else:
                    self.buf += data
                self._expected = max(0, self._expected - size)
            else:
                self.buf += data
            if len(self.buf) + self._chunked > HIGH_WATER and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()
        if self.tls is not None and self.tls.peer_closed:
            self.eof = True  # close_notify came with the data: nothing more will
        self._wake()

    def eof_received(self) -> bool | None:
        self._end(None)
        return True  # keep the write side: the response may still be going out

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._end(exc)
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self.on_lost()
        if self.tls is not None:
            # Nothing more can be written, and the session no longer points back here:
            # a closed connection is freed as its last reference goes, not at the next
            # full garbage collection, which a burst of closed connections (their
            # OpenSSL buffers and all) may wait minutes for.
            self.tls.detach()
        if self.transport is not None:
            # (a transport ended by an error - a reset - keeps its callbacks to itself, a
            # cycle; `close`, a no-op on an ended transport otherwise, drops them)
            self.transport.close()

    def on_lost(self) -> None:
        """The connection is gone (the client side stops what waited on it)."""

    def on_eof(self) -> None:
        """The peer ended its side (FIN or TLS close_notify)."""

    def pause_writing(self) -> None:
        self._drain = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    def _end(self, exc: BaseException | None) -> None:
        first = not self.eof
        self.eof = True
        if exc is not None and self.error is None and not isinstance(exc, TlsClosed):
            # (kept without its traceback, whose frames hold this side: a reference
            # cycle for every connection that ended on an error)
            self.error = exc.with_traceback(None)
        self._wake()
        if first:
            self.on_eof()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def expire(self, now: float) -> None:
        """Called by the sweeper: fail a wait whose deadline has passed."""
        waiter = self._waiter
        if waiter is not None and not waiter.done() and now >= self.deadline:
            self._waiter = None
            waiter.set_exception(TimeoutError(self.waiting))

    # for the coroutine
    def expect(self, body: int) -> None:
        """A body of `body` more bytes is being read (0: no longer): what of it arrives
        while `buf` is empty goes to `chunks`. At 0, chunks not taken go back in front
        of `buf` (a reader that stopped early leaves the bytes as they were)."""
        self._expected = max(0, body - len(self.buf)) if body else 0
        if not body and self.chunks:
            rest = bytes(self.buf)
            self.buf = ReceiveBuffer()
            self.buf += self.take_chunks() + rest

    def take_chunks(self) -> bytes | bytearray:
        """The body bytes kept in `chunks` (they come before anything in `buf`)."""
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.chunks = []
        self._chunked = 0
        return data

    async def more(self, timeout: float, phase: str = "data") -> None:
        """Wait for more plaintext (or the end), at most `timeout` seconds (TimeoutError:
        "no <phase> within <timeout>s"); what both sides gathered goes out first."""
        self.flush()
        if self.partner is not None:
            self.partner.flush()
        if self.eof:
            return
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self.deadline = time.monotonic() + timeout
        self.waiting = f"no {phase} within {timeout:g}s"
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter

    async def send(self, data: bytes | memoryview) -> None:
        """Queue plaintext for this side (see the module docstring for when it goes)."""
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("connection closed")
        self._out.append(data)
        self._out_size += len(data)
        if self._out_size >= OUT_LIMIT:
            self.flush()
            if self._drain is not None:
                await self._drain

    def flush(self) -> None:
        """Encrypt (if TLS) and write what is queued."""
        if not self._out:
            return
        out, self._out, self._out_size = self._out, [], 0
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        if self.tls is not None:
            self.tls.send(data)
        else:
            transport.write(data)

    def write_raw(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        self.flush()
        if self.transport is not None and not self.transport.is_closing():
            if self.tls is not None and self.tls.established:
                self.tls.close()
            self.transport.close()


class Upstream(Side):
    """The upstream half: dialled to the pinned address; over TLS the server
    certificate is verified against public roots plus `network.upstream_ca`."""

    reused = False  # set once it has served a request (a failure then may be a stale close)
    key: tuple[object, ...] = ()  # (sandbox, address, host, tls): what it can serve
    clean = False  # its last response ended as framed and it is not in use
    parked_at = 0.0  # monotonic: when it was parked in the pool (`pool.py`)

    def reusable(self) -> bool:
        """Idle, clean, still open: it can carry the next request of its key."""
        transport = self.transport
        return (self.clean and not self.eof and not self.lost and not len(self.buf)
                and transport is not None and not transport.is_closing()
                and (self.tls is None or self.tls.established))

    @classmethod
    async def open(cls, pinned: Pinned, context: ssl.SSLContext | None, *,
                   connect: float, handshake: float,
                   proxy: UpstreamProxy | None = None) -> Upstream:
        """Dial (through `proxy` unless its no_proxy says direct: `ProxyDialFailed`),
        then (with `context`) the TLS handshake: each phase within its own timeout; a
        timeout raises `PhaseTimeout` naming the phase."""
        side = cls()
        pin(pinned)  # the address dialled is the one that was checked
        ip, port = pinned.address
        loop = asyncio.get_running_loop()
        try:
            try:
                if proxy is not None and proxy.applies(pinned.host, ip, pinned.port):
                    await proxy.open(pinned, lambda: side, timeout=connect)
                else:
                    async with asyncio.timeout(connect):
                        await loop.create_connection(lambda: side, ip, port)
            except TimeoutError:
                raise PhaseTimeout("connect", f"no TCP connection within {connect:g}s "
                                   "(network.timeouts.connect)") from None
            if context is not None:
                assert side.transport is not None
                side.tls = TlsPump(context, side.write_raw, server_side=False,
                                   server_hostname=pinned.host)
                side.tls.start()
                try:
                    async with asyncio.timeout(handshake):  # (no sweeper sees it yet)
                        while not side.tls.established:
                            if side.eof:
                                raise copy.copy(side.error) if side.error else ConnectionResetError(
                                    "the upstream closed the connection during the TLS "
                                    "handshake")
                            await side.more(handshake, "TLS handshake")
                except TimeoutError:
                    raise PhaseTimeout("tls_handshake", f"TCP connected but no TLS handshake "
                                       f"within {handshake:g}s (network.timeouts."
                                       "handshake)") from None
        except BaseException:
            side.close()
            raise
        return side


class PhaseTimeout(TimeoutError):
    """A dial that timed out; `phase`: connect (TCP) or tls_handshake."""

    def __init__(self, phase: str, message: str) -> None:
        super().__init__(message)
        self.phase = phase
