"""The transparent door: connections redirected to the gateway (iptables REDIRECT), up
to the engine that serves them.

The destination is the connection's original address (SO_ORIGINAL_DST) plus the name
the client gives in its first bytes (TLS SNI, or the HTTP Host header); the gate
admits it (`Gate.open_transparent`: the name must resolve to the original address,
the address must pass the destination check, and a registered sandbox's policy
decides). Then, as at the front door: passthrough TLS and `protocol: tcp` go to the
splice, inspected HTTP/1 TLS and every cleartext HTTP connection (its requests'
Host headers are each checked) to the HTTP/1 engine, HTTP/2-only TLS to mitmproxy.

Identity: a sandbox registered by source address (`POST /v1/sandboxes`) is known at
once. Any other source must carry a gateway token where its provider expects an API
key: its connections are intercepted and each request identified by that token.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from gateway.core.refusal import to_http1
from gateway.engines import patches
from gateway.engines.door import Door, Doors
from gateway.engines.first_bytes import FirstBytes, classify
from gateway.pipeline.gate import Refused

log = logging.getLogger("sandbox_gateway")


def original_destination(transport: asyncio.Transport) -> tuple[str, int]:
    """The address the client connected to before the redirect (SO_ORIGINAL_DST)."""
    sock = transport.get_extra_info("socket")  # asyncio's TransportSocket: getsockopt works
    return patches.original_destination(sock)


class TransparentDoor(Door):
    """One redirected connection, until an engine takes it."""

    listener = "transparent"
    engine = "transparent"
    OWNED = ("accepted", "first", "deciding")

    def __init__(self, doors: Doors, handoff: Callable[..., Any]) -> None:
        super().__init__(doors, handoff)
        self.orig: tuple[str, int] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.state != "accepted":
            return  # refused at accept
        assert self.transport is not None and self.client is not None
        self.state = "first"
        try:
            self.orig = original_destination(self.transport)
        except Exception as exc:
            log.warning("transparent connection from %s without an original destination: "
                        "%s", self.client.peer, exc)
            self.transport.close()
            return
        try:
            registered = self.gate.identify_registered(self.client, self.orig)
        except Refused:  # too many connections (audited)
            self.transport.close()
            return
        if registered and self.client.identity is not None:
            asyncio.get_running_loop().create_task(self._maybe_tcp())

    async def _maybe_tcp(self) -> None:
        """A registered sandbox may reach a `protocol: tcp` destination whose server
        speaks first (SSH): decide on the address alone if no bytes come soon."""
        await asyncio.sleep(0.3)
        if self.state == "first" and not self.buf and self.transport is not None \
                and not self.transport.is_closing():
            self.state = "deciding"
            await self._decide(FirstBytes("tcp"))

    def data_received(self, data: bytes) -> None:
        if self.state != "first":
            self.buf += data
            return
        self.buf += data
        first = classify(bytes(self.buf))
        if first is None:
            return
        assert self.transport is not None
        self.transport.pause_reading()
        self.state = "deciding"
        asyncio.get_running_loop().create_task(self._decide(first))

    async def _decide(self, first: FirstBytes) -> None:
        assert self.client is not None and self.transport is not None and self.orig
        self.hold()
        try:
            try:
                tunnel = await self.gate.open_transparent(self.client, self.orig, first.kind,
                                                          first.name)
            except Refused as refused:
                if first.kind == "http":
                    self.transport.write(to_http1(refused.answer))
                self.transport.close()
                return
            if tunnel.passthrough:
                self.to_splice(bytes(self.buf))
            elif first.kind == "tls" and not first.http1:
                self.to_mitmproxy()  # HTTP/2 only
            else:
                self.to_h1(bytes(self.buf),
                           tls_host=tunnel.host if first.kind == "tls" else None)
        except Exception:
            log.exception("the transparent door failed; closing the connection (fail closed)")
            self.transport.close()
