"""What both doors share: accepting a connection, its deadline, and the hand-offs.

A door owns a connection from accept until an engine takes it: it counts it with the
gate (a refusal past the global cap is answered at once), bounds the wait for its
first bytes (`network.timeouts.handshake`), and hands it to the splice, the HTTP/1
engine, or mitmproxy (with every byte read so far and the client the gate admitted).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.core.refusal import to_http1
from gateway.engines.h1.server import Engine, Limits, Timeouts
from gateway.engines.splice import Splices
from gateway.pipeline.gate import Client, Gate, Refused

log = logging.getLogger("sandbox_gateway")


@dataclass(eq=False)
class Doors:
    """What the doors (front and transparent) hand connections to."""

    gate: Gate
    h1: Engine
    splices: Splices
    timeouts: Timeouts
    limits: Limits
    handoffs: dict[tuple[str, int], Client] = field(default_factory=dict)
    deciding: set[Door] = field(default_factory=set)  # doors that still own a connection

    def compact(self) -> None:
        """Give back the room a burst of connections left in the doors' and the HTTP/1
        engine's bookkeeping (sets keep their largest table): after a burst closed."""
        self.deciding = set(self.deciding)
        self.h1.compact()

    def close_all(self) -> None:
        for door in list(self.deciding):
            door.abort()
        self.splices.close_all()
        self.h1.close_all()


class Door(asyncio.Protocol):
    """One accepted connection, until an engine takes it (see the module docstring)."""

    listener = "proxy"
    engine = "frontdoor"  # named on audit lines of what the door itself refuses
    OWNED: tuple[str, ...] = ("accepted", "deciding", "hello")  # the door owns it then

    def __init__(self, doors: Doors, handoff: Callable[..., Any]) -> None:
        self.doors = doors
        self.gate = doors.gate
        self.handoff_cb = handoff  # mitmproxy's handle_stream(reader, writer)
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.client: Client | None = None
        self.state = "accepted"
        self.timer: asyncio.TimerHandle | None = None
        self.ended: str | None = None  # why the door closed the connection, if it did

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername") or ("?", 0)
        self.client = Client((str(peer[0]), int(peer[1])), self.listener, self.engine,
                             end=transport.abort)  # (the splice, h1 and mitmproxy use it)
        try:
            self.gate.opened(self.client)
        except Refused as refused:
            self.state = "refused"
            if self.listener == "proxy":
                transport.write(to_http1(refused.answer))
            transport.close()
            self.gate.closed(self.client)
            return
        self.doors.deciding.add(self)
        self.arm()

    def arm(self) -> None:
        """(Re)start the deadline for the bytes the door waits for."""
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_later(
            self.doors.timeouts.handshake, self._timed_out)

    def hold(self) -> None:
        """The gate is deciding, and may hold the connection while a person answers (ask
        mode, bounded by the ask's own timeout): the handshake deadline pauses."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _timed_out(self) -> None:
        log.debug("connection from %s: %s", self.client.peer if self.client else "?",
                  self.waiting_for())
        self.ended = "handshake_timeout"
        self.abort()

    def waiting_for(self) -> str:
        """What the door was waiting for, for the timeout's log line."""
        return (f"no usable first bytes within {self.doors.timeouts.handshake:g}s "
                "(network.timeouts.handshake)")

    def abort(self) -> None:
        if self.ended is None:
            self.ended = "shutting_down"
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.release()
        if self.state in self.OWNED and self.client is not None:
            try:  # an admitted tunnel that ends here: audited (bytes after the 200)
                self.gate.tunnel_closed(self.client, 0, self.tunnel_bytes(),
                                        self.ended or "client_closed")
            finally:
                self.gate.closed(self.client)

    def tunnel_bytes(self) -> int:
        """Bytes the client sent into its admitted tunnel while the door held it."""
        return len(self.buf)

    def release(self) -> None:
        """The door no longer owns the connection (an engine has it, or it ended)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.doors.deciding.discard(self)

    # -- to the engines ------------------------------------------------------------------

    def to_splice(self, first: bytes) -> None:
        assert self.client is not None and self.transport is not None
        self.release()
        self.state = "splice"
        self.doors.splices.start(self.transport, self.client, first)

    def to_h1(self, first: bytes, *, tls_host: str | None, refused: Refused | None = None
              ) -> None:
        """To the HTTP/1 engine (`refused`: only to answer that refusal inside TLS)."""
        assert self.client is not None and self.transport is not None
        self.release()
        self.state = "h1"
        self.doors.h1.serve(self.transport, self.client, first, tls_host=tls_host,
                            refused=refused)
        self.transport.resume_reading()

    def to_mitmproxy(self, transport_view: Any = None) -> None:
        """Give the connection, every byte read so far and the admitted client to
        mitmproxy (`transport_view`: what mitmproxy writes to, default the transport)."""
        assert self.client is not None and self.transport is not None
        self.release()
        self.state = "mitmproxy"
        self.client.engine = "mitmproxy"
        self.doors.handoffs[self.client.peer] = self.client
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=2**16, loop=loop)
        reader.feed_data(bytes(self.buf))
        protocol = asyncio.StreamReaderProtocol(reader, self.handoff_cb, loop=loop)
        self.transport.set_protocol(protocol)
        protocol.connection_made(transport_view or self.transport)
        self.transport.resume_reading()
