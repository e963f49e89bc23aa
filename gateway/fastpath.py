"""The front door: CONNECTs served without mitmproxy's layer stack when they can be.

Every connection to the proxy port is accepted here first. The CONNECT head is read
and, when it is the common happy case — a valid token, a tunnel the policy allows, a
destination that passes the address check — the gateway answers `200` itself:

- a tunnel allowed **without inspection** is spliced: the checked address is dialled
  and bytes are relayed between two asyncio transports (no per-chunk events, hooks or
  layers; bytes are counted for the audit line). Its first bytes must be a TLS
  ClientHello unless the rule is `protocol: tcp`.
- a tunnel that **needs inspection** waits for the ClientHello: one offering HTTP/1.1
  (or no ALPN) is served by `gateway.intercept` (the same addon hooks, without the
  layer machinery); HTTP/2-only or non-TLS traffic goes to mitmproxy, whose own `200`
  is then dropped because the client already has one.

Everything else — plain HTTP, a missing or bad token, a denial, a refused destination,
any error before the `200` — is handed to mitmproxy untouched (the bytes read so far
are replayed into its reader), where the full addon chain decides and answers. An
error after the `200` closes both sides.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy.layers.tls import parse_client_hello

from gateway import metrics
from gateway.addons.identify import proxy_credentials
from gateway.audit import Auditor
from gateway.destination import DestinationError, normalize_host, parse_authority
from gateway.intercept import Engine, InterceptedTunnel
from gateway.policy import Decision, Policy, Request, decide
from gateway.resolver import DestinationGuard, DestinationRefused, Pinned, pin
from gateway.tokens import Identity, TokenRefused, TokenService

log = logging.getLogger("sandbox_gateway")

MAX_HEAD = 16 * 1024
HEAD_TIMEOUT = 30.0
HIGH_WATER = 1024 * 1024
READ_SIZE = 256 * 1024
FIRST_READ_SIZE = 16 * 1024
ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"


class FastPath:
    """What the fast path needs from the gateway, and the decision it takes."""

    def __init__(self, tokens: TokenService, policy_lookup: Any, guard: DestinationGuard,
                 auditor: Auditor) -> None:
        self.tokens = tokens
        self.policy_lookup = policy_lookup
        self.guard = guard
        self.auditor = auditor
        self.doors: set[FrontDoor] = set()  # connections the fast path still owns
        self.engine: Engine | None = None  # the HTTP/1 intercept path, once mitmproxy is up

    def close_all(self) -> None:
        """Close every connection the fast path owns (shutdown)."""
        for door in list(self.doors):
            door.close()
        if self.engine is not None:
            self.engine.close_all()

    async def decide(self, head: bytes) -> Connect | None:
        """What to do with the CONNECT `head` when it is the happy case; None hands the
        connection to mitmproxy (which answers every refusal)."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or parts[0] != "CONNECT":
            return None
        auth = None
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "proxy-authorization":
                auth = value.strip()
        creds = proxy_credentials(auth) if auth else None
        if creds is None:
            return None
        user, token = creds
        try:
            identity = self.tokens.verify(token)
            host, port = parse_authority(parts[1])
            host = normalize_host(host)
        except (TokenRefused, DestinationError):
            return None
        if user is not None and user != identity.sandbox:
            return None
        policy: Policy | None = self.policy_lookup(identity.policy)
        if policy is None:
            return None
        started = time.perf_counter()
        decision = decide(policy, Request(None, "https", host, port, None))
        metrics.DECISION_SECONDS.observe(time.perf_counter() - started)
        if decision.result != "allow":
            return None
        intercept = decision.inspect
        if intercept and (self.engine is None or (decision.rule is not None
                                                    and decision.rule.protocol == "tcp")):
            return None
        try:
            pinned = await self.guard.check(host, port)
        except DestinationRefused:
            return None
        return Connect(identity, token, decision, pinned, intercept)


@dataclass(slots=True)
class Connect:
    """A CONNECT the fast path serves: spliced, or intercepted by `gateway.intercept`."""

    identity: Identity
    token: str
    decision: Decision
    pinned: Pinned
    intercept: bool


class FrontDoor(asyncio.Protocol):
    """One accepted proxy connection: decides, then splices or hands off to mitmproxy."""

    def __init__(self, fast: FastPath, handoff: Any) -> None:
        self.fast = fast
        self.handoff_cb = handoff  # mitmproxy's handle_stream(reader, writer)
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.state = "head"
        self.peer: _Upstream | None = None
        self.pending = bytearray()  # client bytes before the upstream is connected
        self.bytes_out = 0
        self.tunnel: Connect | None = None
        self.started = time.time()
        self.head_len = 0
        self.timer: asyncio.TimerHandle | None = None
        self.first_checked = False
        self.client_ended = False  # the sandbox sent EOF (its write side is done)
        self.upstream_ended = False  # the upstream sent EOF

    # -- accepting and deciding ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.fast.doors.add(self)
        self.timer = asyncio.get_running_loop().call_later(HEAD_TIMEOUT, transport.close)

    def data_received(self, data: bytes) -> None:
        if self.state == "relay":
            self._to_upstream(data)
            return
        self.buf += data
        if self.state == "hello":
            self._check_hello()
            return
        if self.state != "head":
            return
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 and len(self.buf) < MAX_HEAD:
            return
        assert self.transport is not None
        self.transport.pause_reading()
        self.state = "deciding"
        head = bytes(self.buf[: end + 4]) if end >= 0 else b""
        asyncio.get_running_loop().create_task(self._decide(head))

    async def _decide(self, head: bytes) -> None:
        try:
            tunnel = await self.fast.decide(head) if head else None
        except Exception:
            log.exception("fast path decision failed; handing the connection to mitmproxy")
            tunnel = None
        if tunnel is None:
            self._handoff()
            return
        try:
            if tunnel.intercept:
                self._await_hello(head, tunnel)
            else:
                await self._splice(head, tunnel)
        except Exception:
            log.exception("fast path failed; closing (fail closed)")
            self._close()

    # -- intercepting ----------------------------------------------------------------

    def _await_hello(self, head: bytes, tunnel: Connect) -> None:
        """Answer 200 and wait for the ClientHello: HTTP/1.1 clients go to the intercept
        path, anything else (HTTP/2 only, not TLS) to mitmproxy."""
        assert self.transport is not None
        self.tunnel = tunnel
        self.head_len = len(head)
        self.state = "hello"
        self.transport.write(ESTABLISHED)
        self.transport.resume_reading()
        self._check_hello()

    def _check_hello(self) -> None:
        rest = bytes(self.buf[self.head_len:])
        if len(rest) < 3:
            return  # a TLS record header is 3 bytes
        hello = None
        if starts_like_tls_record(rest):
            try:
                hello = parse_client_hello(rest)
            except ValueError:
                pass
            else:
                if hello is None and len(rest) < MAX_HEAD:
                    return  # the ClientHello is still arriving
        assert self.transport is not None
        if hello is None or (hello.alpn_protocols
                             and b"http/1.1" not in hello.alpn_protocols):
            self.transport.pause_reading()
            self._handoff(answered=True)
            return
        if self.timer is not None:
            self.timer.cancel()
        self.fast.doors.discard(self)
        self.state = "intercepted"
        assert self.tunnel is not None and self.fast.engine is not None
        t = self.tunnel
        peer = self.transport.get_extra_info("peername")
        sock = self.transport.get_extra_info("sockname")
        try:
            InterceptedTunnel(self.fast.engine, t.identity, t.token, t.decision, t.pinned,
                              peer[:2], sock[:2], hello.sni).start(self.transport, rest)
        except Exception:
            log.exception("starting the intercept path failed; closing (fail closed)")
            self.transport.close()

    def _handoff(self, answered: bool = False) -> None:
        """Give the connection, and every byte read so far, to mitmproxy. `answered`: the
        fast path already sent its 200, so mitmproxy's own 200 is dropped."""
        assert self.transport is not None
        if self.timer is not None:
            self.timer.cancel()
        self.fast.doors.discard(self)  # mitmproxy owns it from here
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=2**16, loop=loop)
        reader.feed_data(bytes(self.buf))
        protocol = asyncio.StreamReaderProtocol(reader, self.handoff_cb, loop=loop)
        self.transport.set_protocol(protocol)
        protocol.connection_made(
            _Answered(self.transport) if answered else self.transport)  # type: ignore[arg-type]
        self.state = "handed-off"
        self.transport.resume_reading()

    async def _splice(self, head: bytes, tunnel: Connect) -> None:
        """Answer 200; the upstream is dialled once the first bytes passed the check."""
        assert self.transport is not None
        if self.timer is not None:
            self.timer.cancel()
        self.tunnel = tunnel
        metrics.OPEN_CONNECTIONS.inc()
        rest = bytes(self.buf[len(head):])
        self.buf = bytearray()
        self.state = "relay"
        self.transport.set_write_buffer_limits(high=HIGH_WATER)
        self.transport.write(ESTABLISHED)
        rule = tunnel.decision.rule
        if rule is not None and rule.protocol == "tcp":
            # Raw TCP (e.g. SSH, where the server speaks first): nothing to check, dial now.
            self.first_checked = True
            asyncio.get_running_loop().create_task(self._dial(tunnel.pinned))
        if rest:
            self._to_upstream(rest)
        self.transport.resume_reading()

    async def _dial(self, pinned: Pinned) -> None:
        pin(pinned)  # the address we connect to is the one that was checked
        ip, port = pinned.address
        loop = asyncio.get_running_loop()
        try:
            _, upstream = await loop.create_connection(lambda: _Upstream(self), ip, port)
        except OSError as exc:
            log.info("passthrough to %s:%d (%s) failed: %s", pinned.host, pinned.port, ip, exc)
            self._close()
            return
        except Exception:
            log.exception("passthrough dial failed; closing (fail closed)")
            self._close()
            return
        self.peer = upstream
        if self.transport is None or self.transport.is_closing():
            upstream.transport.close()  # type: ignore[union-attr]
            return
        if self.pending:
            upstream.write(bytes(self.pending))
            self.pending.clear()
            self.transport.resume_reading()
        if self.client_ended:
            self._half_close_upstream()

    # -- relaying ------------------------------------------------------------------------

    def _to_upstream(self, data: bytes) -> None:
        if not self.first_checked:
            self.pending += data
            if len(self.pending) < 3:
                return  # a TLS record header is 3 bytes: wait for them
            data, self.pending = bytes(self.pending), bytearray()
            self.first_checked = True
            assert self.tunnel is not None
            try:
                tls = starts_like_tls_record(data)
            except Exception:
                log.exception("checking the first tunnel bytes failed; closing (fail closed)")
                tls = False
            if not tls:
                log.warning("refused tunnel bytes: non-TLS bytes in a tunnel to %s; add "
                            "protocol: tcp to the rule to allow raw TCP", self.tunnel.pinned.host)
                self._close()
                return
            asyncio.get_running_loop().create_task(self._dial(self.tunnel.pinned))
        self.bytes_out += len(data)
        if self.peer is None or self.peer.transport is None:
            self.pending += data
            if len(self.pending) > HIGH_WATER and self.transport is not None:
                self.transport.pause_reading()  # resumed once the upstream is connected
            return
        self.peer.write(data)

    def pause_writing(self) -> None:
        if self.peer is not None:
            self.peer.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None:
            self.peer.resume_reading()

    def eof_received(self) -> bool | None:
        """The sandbox finished sending: pass the EOF on and keep reading the upstream's
        answer; once the upstream has ended too, the tunnel is over (closed, audited)."""
        if self.state != "relay":
            return None
        self.client_ended = True
        if self.upstream_ended:
            self._close()
            return True
        if self.peer is not None and self.peer.transport is not None:
            self._half_close_upstream()
        elif not self.first_checked or not self.pending:
            return None  # nothing will ever be dialled or sent: close now
        return True  # the dial is under way; `_dial` forwards the EOF

    def _half_close_upstream(self) -> None:
        assert self.peer is not None and self.peer.transport is not None
        if self.peer.transport.can_write_eof():
            self.peer.transport.write_eof()
        else:
            self._close()

    def upstream_eof(self) -> bool:
        """The upstream finished sending (see `eof_received`)."""
        self.upstream_ended = True
        transport = self.transport
        if self.client_ended or transport is None or not transport.can_write_eof():
            self._close()
            return False
        transport.write_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.fast.doors.discard(self)
        if self.state == "relay":
            self._finish()

    def close(self) -> None:
        """Close both sides (shutdown, or fail closed)."""
        self._close()

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    def _finish(self) -> None:
        if self.tunnel is None:
            return
        tunnel, self.tunnel = self.tunnel, None
        metrics.OPEN_CONNECTIONS.dec()
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()
        identity, decision, pinned = tunnel.identity, tunnel.decision, tunnel.pinned
        peer = self.transport.get_extra_info("peername") if self.transport else None
        self.fast.auditor.passthrough_closed(
            identity, decision, peer, pinned.host, pinned.port, self.started,
            self.peer.bytes_in if self.peer else 0, self.bytes_out)


class _Answered:
    """mitmproxy's view of a connection whose CONNECT the fast path already answered:
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
                if len(self._head) > MAX_HEAD:
                    self._transport.close()
                return
            head, data = self._head[: end + 4], self._head[end + 4:]
            self._skipping, self._head = False, b""
            if not head.startswith(b"HTTP/1.1 200 "):
                log.info("mitmproxy refused a tunnel the fast path had accepted; closing")
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


class _Upstream(asyncio.BufferedProtocol):
    """The upstream side of a spliced tunnel. Downloads are the bulk of passthrough
    traffic, so it reads into a reusable buffer (no allocation per read) that starts
    small (idle tunnels stay cheap) and grows while reads fill it; a buffer the client
    transport still holds (a write it could not finish) is never reused."""

    def __init__(self, front: FrontDoor) -> None:
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
        if self.front.transport is not None:
            self.front.transport.close()
