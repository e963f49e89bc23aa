"""The front door: every connection to the proxy port, up to the engine that serves it.

It reads the first request head. A `CONNECT` is identified and admitted by the gate
(refusals are answered here, with the gate's rendering), answered `200`, and its first
bytes are checked by the gate (TLS in a passthrough tunnel, SNI = the tunnel's host).
Then the connection goes to its engine:

- passthrough and `protocol: tcp` tunnels → the splice;
- inspected tunnels whose ClientHello offers HTTP/1.1 (or no ALPN), and cleartext
  inside a tunnel → the HTTP/1 engine;
- HTTP/2-only ClientHellos → mitmproxy, with the admitted client handed over (the
  gate does not decide twice) and mitmproxy's own `200` dropped.

A plain proxy request (`GET http://…`) goes to the HTTP/1 engine, which identifies
each request by its own `Proxy-Authorization`. Every wait here has a deadline
(`network.timeouts.handshake`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from gateway.core.phrases import error_phrase
from gateway.core.refusal import Answer, to_http1
from gateway.engines.door import Door, Doors
from gateway.engines.first_bytes import MAX_FIRST, classify
from gateway.engines.patches import parse_request_head
from gateway.pipeline.gate import Refused

log = logging.getLogger("sandbox_gateway")

ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"


class FrontDoor(Door):
    """One accepted proxy connection, until an engine takes it."""

    listener = "proxy"
    OWNED = ("accepted", "head", "deciding", "hello")

    def __init__(self, doors: Doors, handoff: Callable[..., Any]) -> None:
        super().__init__(doors, handoff)
        self.state = "head"
        self.head_len = 0
        self.started = time.time()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.state == "hello":
            self._check_hello()
            return
        if self.state != "head":
            return
        end = self.buf.find(b"\r\n\r\n")
        limit = self.doors.limits.max_header_bytes
        if end < 0 and len(self.buf) < limit:
            return
        assert self.transport is not None
        self.transport.pause_reading()
        self.state = "deciding"
        if end < 0 or end + 4 > limit:
            assert self.client is not None
            self._send(self.gate.unparsable(self.client, f"the request head is larger than "
                                            f"{limit} bytes (limits.max_header_bytes)"))
            return
        self.head_len = end + 4
        asyncio.get_running_loop().create_task(self._decide(bytes(self.buf[:end])))

    def waiting_for(self) -> str:
        what = ("complete CONNECT or request head" if self.state in ("head", "deciding")
                else "first bytes (TLS ClientHello) in the tunnel after its 200")
        return (f"no {what} within {self.doors.timeouts.handshake:g}s "
                "(network.timeouts.handshake)")

    def tunnel_bytes(self) -> int:
        return max(0, len(self.buf) - self.head_len) if self.head_len else 0

    def _send(self, answer: Answer) -> None:
        """Answer a refusal the gate audited, and close."""
        assert self.transport is not None
        self.transport.write(to_http1(answer))
        self.transport.close()

    # -- deciding ------------------------------------------------------------------------

    async def _decide(self, head: bytes) -> None:
        assert self.client is not None and self.transport is not None
        try:
            try:  # (the parser every HTTP/1 head goes through)
                request = parse_request_head(head + b"\r\n\r\n")
            except ValueError as exc:
                self._send(self.gate.unparsable(
                    self.client, f"the request head could not be parsed ({error_phrase(str(exc))})"
                    "; send CONNECT host:port HTTP/1.1 or an absolute-URL request"))
                return
            if request.http_version not in (b"1.1", b"1.0"):
                self._send(self.gate.unparsable(self.client, "not an HTTP/1.x request; send "
                                                "CONNECT host:port HTTP/1.1 or an absolute-URL "
                                                "request"))
                return
            if request.method != b"CONNECT":
                self.to_h1(bytes(self.buf), tls_host=None)  # a plain proxy request
                return
            authority = request.target.decode("latin-1")
            credentials = [v for k, v in request.fields if k.lower() == b"proxy-authorization"]
            if len(credentials) > 1:
                self._send(self.gate.unparsable(
                    self.client, "more than one Proxy-Authorization field; send one"))
                return
            auth = credentials[0].decode("latin-1") if credentials else None
            self.hold()
            try:
                tunnel = await self.gate.connect(self.client, authority, auth,
                                                 started=self.started)
            except Refused as refused:  # audited by the gate
                if refused.inside is not None:  # answered inside TLS, to the request
                    self.transport.write(ESTABLISHED)
                    self.to_h1(bytes(self.buf[self.head_len:]), tls_host=refused.inside,
                               refused=refused)
                    return
                self.transport.write(to_http1(refused.answer))
                self.transport.close()
                return
            self.transport.write(ESTABLISHED)
            self.state = "hello"
            self.arm()
            if tunnel.tcp:  # raw TCP: the server may speak first; nothing to check
                self.to_splice(bytes(self.buf[self.head_len:]))
                return
            self.transport.resume_reading()
            self._check_hello()
        except Exception:
            if self.state == "deciding":  # (logged with its traceback by the gate)
                self._send(self.gate.failed(self.client))
            else:
                log.exception("the front door failed; closing the connection (fail closed)")
            self.transport.close()

    def _check_hello(self) -> None:
        """The tunnel's first bytes: checked by the gate, then to their engine."""
        assert self.client is not None and self.transport is not None
        try:
            first = classify(bytes(self.buf[self.head_len:]), http=False)
            if first is None:
                return
            self.transport.pause_reading()
            self.gate.check_hello(self.client, first.name, tls=first.kind == "tls")
        except Refused:  # audited; past the 200 the client can only be cut off
            self.transport.close()
            return
        except Exception:
            log.exception("checking the tunnel's first bytes failed; closing (fail closed)")
            self.transport.close()
            return
        tunnel = self.client.tunnel
        assert tunnel is not None
        rest = bytes(self.buf[self.head_len:])
        if tunnel.passthrough:
            self.to_splice(rest)
        elif first.kind != "tls":
            self.to_h1(rest, tls_host=None)
        elif first.http1:
            self.to_h1(rest, tls_host=tunnel.host)
        else:  # HTTP/2 only: mitmproxy, whose own 200 is dropped (the client has one)
            self.to_mitmproxy(_Answered(self.transport))


class _Answered:
    """mitmproxy's view of a connection whose CONNECT the front door already answered:
    mitmproxy's own `200` is dropped; any other answer closes the connection (the client
    is past the CONNECT and could not read it). Everything else is the transport."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._head = b""
        self._skipping = True

    def write(self, data: bytes) -> None:
        if self._skipping:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                if len(self._head) > MAX_FIRST:
                    self._transport.close()
                return
            head, data = self._head[: end + 4], self._head[end + 4:]
            self._skipping, self._head = False, b""
            if not head.startswith(b"HTTP/1.1 200 "):
                log.info("mitmproxy refused a tunnel the front door had accepted; closing")
                self._transport.close()
                return
            if not data:
                return
        self._transport.write(data)

    def writelines(self, lines: list[bytes]) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
