"""The HTTP/1 engine: serves inspected HTTP/1.x connections and asks the gate about each.

A connection comes here from the front door (an intercepted CONNECT tunnel whose
ClientHello offers HTTP/1.1 or no ALPN, a cleartext tunnel, or plain proxy requests)
or from the transparent door. The engine reads each request head (h11's parser),
calls `Gate.begin`, and either sends the gate's answer or serves the `Exchange`:
dials the pinned address (or reuses the kept-alive upstream connection), forwards the
head and body through the exchange's checks, relays the response through its
redaction, and finishes it. The engine frames each side itself (chunked to HTTP/1.1
clients when the length is unknown, close-delimited to HTTP/1.0 ones) and never
forwards hop-by-hop fields.

Lifecycle: every wait has a timeout (`network.timeouts`: client idle between
requests, handshake and request-head time, upstream connect, upstream read → `504`);
a client that goes away cancels its exchange and closes the upstream; an upstream
that closed a kept-alive connection is redialled, and an idempotent request that
failed on a reused connection before any response byte is retried once. Any error
closes the connection (fail closed).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from dataclasses import dataclass
from typing import Any

import h11

from gateway.core.messages import RequestHead
from gateway.core.phrases import error_phrase
from gateway.core.refusal import Answer, Refusal, to_http1
from gateway.engines.h1 import framing
from gateway.engines.h1.framing import ProtocolError
from gateway.engines.h1.pool import LIMIT as POOL_LIMIT
from gateway.engines.h1.pool import UpstreamPool
from gateway.engines.h1.side import PhaseTimeout, Side, Upstream
from gateway.engines.h1.websocket import relay
from gateway.engines.patches import (
    ChunkedReader,
    ContentLengthReader,
    Http10Reader,
    RawResponse,
    read_request_head,
    read_response_head,
)
from gateway.net.tls import LeafContexts, TlsClosed
from gateway.net.upstream_proxy import ProxyDialFailed, UpstreamProxy
from gateway.observability import metrics
from gateway.pipeline.exchange import Exchange, no_body
from gateway.pipeline.gate import Client, Gate, Refused

log = logging.getLogger("sandbox_gateway")

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
BUFFER_LIMIT = 1024 * 1024
IDEMPOTENT = frozenset(("GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"))
REPLAY_LIMIT = 64 * 1024  # a request is kept for one retry if it is at most this large


@dataclass(frozen=True, slots=True)
class Timeouts:
    """`network.timeouts` (seconds)."""

    connect: float = 10.0
    read: float = 300.0
    client_idle: float = 600.0
    handshake: float = 30.0


@dataclass(frozen=True, slots=True)
class Limits:
    max_header_bytes: int = 64 * 1024
    max_websocket_message: int = 16 * 1024 * 1024


class Engine:
    """What every HTTP/1 connection shares, and the one sweeper that ends waits past
    their deadline and closes idle upstream connections."""

    def __init__(self, gate: Gate, leaves: LeafContexts, upstream_tls: ssl.SSLContext, *,
                 timeouts: Timeouts = Timeouts(), limits: Limits = Limits(),
                 upstream_idle: float = 30.0, pool_limit: int = POOL_LIMIT,
                 proxy: UpstreamProxy | None = None) -> None:
        self.gate = gate
        self.proxy = proxy  # network.upstream_proxy
        self.leaves = leaves
        self.upstream_tls = upstream_tls
        self.timeouts = timeouts
        self.limits = limits
        self.upstream_idle = upstream_idle
        self.pool = UpstreamPool(upstream_idle, pool_limit)
        self.connections: set[Connection] = set()
        self.draining = False  # shutting down: every response closes its connection
        self._sweeper: asyncio.Task[None] | None = None

    def compact(self) -> None:
        """Drop the table a burst of connections grew (see `Doors.compact`)."""
        self.connections = set(self.connections)

    def close_idle(self) -> None:
        """Close connections with no request in flight (a drain in progress)."""
        self.pool.close_all()
        for conn in list(self.connections):
            if conn.exchange is None:
                conn.abort()

    def serve(self, transport: asyncio.Transport, client: Client, first: bytes, *,
              tls_host: str | None, refused: Refused | None = None) -> Connection:
        """Take over `transport`: TLS with a leaf for `tls_host` (the tunnel's host), or
        cleartext when None. `first`: bytes already read (the ClientHello, a head).
        `refused`: a refused CONNECT, answered to the first request inside the TLS."""
        conn = Connection(self, client)
        conn.refused = refused
        client.engine = "h1"
        conn.connection_made(transport)
        if tls_host is not None:
            conn.tls = self.leaves.server(tls_host, conn.write_raw)
        transport.set_protocol(conn)
        self.connections.add(conn)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        conn.task = asyncio.get_running_loop().create_task(conn.serve())
        if first:
            conn.data_received(first)
        return conn

    async def _sweep(self) -> None:
        tick = max(0.05, min(0.5, self.timeouts.handshake / 4, self.timeouts.read / 4,
                             self.upstream_idle / 4 if self.upstream_idle > 0 else 0.5))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            idle_before = now - self.upstream_idle
            self.pool.expire(now)
            for conn in list(self.connections):
                try:
                    conn.expire(now)
                    upstream = conn.upstream
                    if upstream is not None:
                        upstream.expire(now)
                        if self.upstream_idle > 0 and conn.idle_since is not None \
                                and conn.idle_since <= idle_before:
                            conn.drop_upstream()
                except Exception:  # one bad connection must not stop the sweeping
                    log.exception("sweeping an HTTP/1 connection failed; closing it")
                    conn.abort()

    def close_all(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self.pool.close_all()
        for conn in list(self.connections):
            conn.abort()


class Connection(Side):
    """The client side of one HTTP/1 connection, and the coroutine that serves it."""

    def __init__(self, engine: Engine, client: Client) -> None:
        super().__init__()
        self.engine = engine
        self.client = client
        self.gate = engine.gate
        self.upstream: Upstream | None = None
        self.idle_since: float | None = None  # monotonic end of the last exchange
        self.task: asyncio.Task[None] | None = None
        self.exchange: Exchange | None = None
        self.refused: Refused | None = None  # serve only this refusal's answer

    # -- lifecycle -------------------------------------------------------------------------

    def on_lost(self) -> None:
        """The client's connection is gone: stop whatever it was waiting for."""
        if self.task is not None and not self.task.done() and self.exchange is not None:
            self.task.cancel()

    def on_eof(self) -> None:
        """The client closed its side (FIN or TLS close_notify) with a request upstream:
        it gave up waiting (as nginx does, the upstream call is dropped). A WebSocket
        relay (`upstream` handed to the upgrade) ends by its own close instead."""
        if self.upstream is not None:
            self.on_lost()

    def abort(self) -> None:
        """Close both sides now (shutdown, or a failure)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self._shutdown()

    def _shutdown(self) -> None:
        self.engine.connections.discard(self)
        self.release_upstream()
        self.close()
        self.gate.closed(self.client)

    def drop_upstream(self) -> None:
        if self.upstream is not None:
            self.upstream.close()
            self.upstream = self.partner = None
        self.idle_since = None

    def release_upstream(self) -> None:
        """Done with the upstream connection: parked for this sandbox's next connection
        to the same destination if it is idle and clean (`pool.py`), else closed."""
        upstream = self.upstream
        if upstream is None or self.exchange is not None or self.engine.draining:
            self.drop_upstream()
            return
        self.upstream = self.partner = None
        self.idle_since = None
        self.engine.pool.park(upstream, time.monotonic())

    def write_answer(self, answer: Answer) -> None:
        """Send an answer the gateway made (a refusal, the local API) now."""
        data = to_http1(answer)
        self.flush()
        if self.tls is not None:
            if self.tls.established:
                self.tls.send(data)
        else:
            self.write_raw(data)

    async def serve(self) -> None:
        timeouts = self.engine.timeouts
        ended = "connection_closed"
        try:
            if self.refused is not None:
                await self._answer_refused(self.refused, timeouts)
                return
            while True:
                head = await self._read_request(timeouts)
                if head is None or not await self._exchange(head):
                    break
        except ProtocolError as exc:
            why = f"the request could not be parsed: {error_phrase(str(exc))}"  # (no bytes)
            ex, self.exchange = self.exchange, None
            if ex is not None:  # a malformed body: the exchange's one line is the refusal
                self.write_answer(ex.abort(Refusal("bad_request", why)))
            else:
                tunnel = self.client.tunnel
                self.write_answer(self.gate.unparsable(
                    self.client, why, host=tunnel.host if tunnel else None,
                    port=tunnel.port if tunnel else None))
        except TimeoutError as exc:
            log.debug("connection from %s: %s", self.client.peer, exc or "timed out")
            ended = "client_timeout"
        except (ConnectionError, TlsClosed, ssl.SSLError, asyncio.CancelledError):
            pass
        except Exception:
            log.exception("HTTP/1 connection failed; closing it (fail closed)")
        finally:
            if self.exchange is not None:  # cut off mid-exchange (client gone, error):
                sent = self.exchange.response_head  # (the status it was answered, if it was)
                self.exchange.finish(sent.status if sent is not None else None, error=ended)
                self.exchange = None
            self._shutdown()

    async def _answer_refused(self, refused: Refused, timeouts: Timeouts) -> None:
        """A refused CONNECT answered inside TLS: the first request gets the refusal,
        then the connection closes. Whatever else comes (no TLS, no HTTP/1, nothing in
        time) just closes it: the refusal's audit line was written at the CONNECT."""
        try:
            head = await self._read_request(timeouts)
        except (ProtocolError, TimeoutError, TlsClosed, ssl.SSLError, ConnectionError):
            return
        if head is not None:
            self.write_answer(self.gate.answer_inside(refused, head))
            self.flush()

    async def _read_request(self, timeouts: Timeouts) -> RequestHead | None:
        """The next request head; None at a clean end before one started."""
        limit = self.engine.limits.max_header_bytes
        while True:
            before = len(self.buf)
            try:
                event = read_request_head(self.buf)
            except h11.ProtocolError as exc:
                raise ProtocolError(str(exc)) from None
            if event is not None:
                if before - len(self.buf) > limit:
                    raise ProtocolError(f"the request head is larger than {limit} bytes "
                                        "(limits.max_header_bytes)")
                return framing.request_head(event)
            if len(self.buf) > limit:
                raise ProtocolError(f"the request head is larger than {limit} bytes "
                                    "(limits.max_header_bytes)")
            if self.eof:
                if len(self.buf):
                    raise ProtocolError("the connection closed in the middle of a request head")
                return None
            if self.tls is not None and not self.tls.established:
                await self.more(timeouts.handshake, "TLS handshake from the client")
            elif len(self.buf):
                await self.more(timeouts.handshake, "complete request head")
            else:
                await self.more(timeouts.client_idle, "request (client idle)")

    async def _body(self, side: Side, size: int | None, timeout: float,
                    trailers: list[list[tuple[bytes, bytes]]] | None = None,
                    phase: str = "request body bytes") -> Any:
        """A message body framed by `size` (Content-Length, None = chunked, -1 = until
        close), de-chunked, as it arrives; chunked trailers are put in `trailers`."""
        if size == 0:
            return
        reader: Any = (ChunkedReader() if size is None else Http10Reader() if size == -1
                       else ContentLengthReader(size))
        # A Content-Length body: what arrives of it with nothing before it in the buffer
        # is kept as it came (`side.chunks`), taken before the buffer's bytes.
        # (a body already whole in the buffer, the small answer's usual case: no need)
        direct = False
        if size is not None and size > len(side.buf):
            direct = True
            side.expect(size)
        pieces: list[bytes | bytearray] = []
        try:
            while True:
                if direct and side.chunks:
                    try:
                        reader.took(len(data := side.take_chunks()))
                    except h11.ProtocolError as exc:
                        raise ProtocolError(f"bad message body: {exc}") from None
                    pieces.append(data)
                    continue
                try:
                    event = reader(side.buf)
                    if event is None and side.eof:
                        event = reader.read_eof()
                except h11.ProtocolError as exc:
                    raise ProtocolError(f"bad message body: {exc}") from None
                if isinstance(event, h11.Data):
                    if event.data:  # gathered while the buffer holds more: one piece a read
                        pieces.append(bytes(event.data))
                    continue
                if pieces:
                    yield pieces[0] if len(pieces) == 1 else b"".join(pieces)
                    pieces = []
                    if event is None:
                        continue  # (more may have arrived while the consumer was sending)
                if event is None:
                    await side.more(timeout, phase)
                else:
                    if trailers is not None and event.headers:
                        trailers.append(list(event.headers.raw_items()))
                    return
        finally:
            if direct:
                side.expect(0)

    # -- one exchange ------------------------------------------------------------------------

    async def _exchange(self, head: RequestHead) -> bool:
        """Serve one request; True to keep the connection for the next one."""
        self.idle_since = None
        size = framing.request_body_size(head)
        client_close = _wants_close(head.http_version, head.headers.get_all("connection"))
        expect = (head.headers.get("expect") or "").lower() == "100-continue"
        proxy_auth = head.headers.get("proxy-authorization")
        result = await self.gate.begin(self.client, head, tls=self.tls is not None,
                                       proxy_authorization=proxy_auth)
        if isinstance(result, Answer):
            return await self._answer(result, size, expect, client_close)
        ex = self.exchange = result
        if expect:
            ex.head.headers.remove("expect")
            await self.send(CONTINUE)
        websocket = (ex.head.headers.get("upgrade") or "").strip().lower() == "websocket"
        # The body is read first, up to the exchange's hold limit (1 MiB; a model
        # allowlist reading the body: 32 MiB): one that ends within it is checked whole
        # before anything is sent (a leak then reaches no upstream at all).
        trailers: list[list[tuple[bytes, bytes]]] = []
        start: list[bytes] = []
        buffered = 0
        limit = ex.hold_limit
        try:
            if size == 0:  # no body (a GET's usual case): checked whole, without a reader
                whole = await ex.request_decided(b"", None)
                return await self._send_whole(ex, head, size, whole, trailers, websocket,
                                              client_close)
            body = self._body(self, size, self.engine.timeouts.client_idle, trailers)
            async for data in body:
                start.append(data)
                buffered += len(data)
                if buffered > limit:
                    break
            else:
                whole = await ex.request_decided(b"".join(start),
                                                 trailers[0] if trailers else None)
                return await self._send_whole(ex, head, size, whole, trailers, websocket,
                                              client_close)
            ex.streaming()  # refused if the head must be signed over the whole body
        except Refusal as refusal:
            self.exchange = None
            self.write_answer(ex.abort(refusal))
            return False
        request = framing.serialize_request(ex.head, size, upgrade=websocket)
        upstream = await self._connect(ex)
        if upstream is None:
            return False
        await upstream.send(request)
        if not await self._forward_body(ex, upstream, size, start, body, trailers):
            return False
        return await self._relay_response(ex, upstream, head, client_close, None)

    async def _send_whole(self, ex: Exchange, head: RequestHead, size: int | None,
                          body: bytes, trailers: list[list[tuple[bytes, bytes]]],
                          websocket: bool, client_close: bool) -> bool:
        """A request whose body was read and checked whole: one write upstream."""
        fields = trailers[0] if trailers else []
        if size is not None or not fields:
            size = len(body)  # (metering or an MCP relay may have changed it; chunked
            #  without trailers too)
        request = framing.serialize_request(ex.head, size, upgrade=websocket)
        if size is None:
            request += (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n" + \
                b"".join(k + b": " + v + b"\r\n" for k, v in fields) + b"\r\n"
        else:
            request += body
        upstream = await self._connect(ex)
        if upstream is None:
            return False
        await upstream.send(request)
        replay = [request] if len(request) <= REPLAY_LIMIT else None
        return await self._relay_response(ex, upstream, head, client_close, replay)

    async def _answer(self, answer: Answer, size: int | None, expect: bool,
                      client_close: bool) -> bool:
        """Send a gateway-made answer. The request's body is read and dropped first (up
        to 8 MiB; closing with unread bytes would make the kernel reset the connection
        before the client reads the answer); a client waiting for `100 Continue` never
        sends its body, so it is answered at once and the connection closed."""
        close = answer.close or client_close
        if size != 0:
            if expect:
                close = True
            else:
                dropped = 0
                try:
                    async for chunk in self._body(self, size, self.engine.timeouts.handshake):
                        dropped += len(chunk)
                        if dropped > 8 * BUFFER_LIMIT:
                            close = True
                            break
                except (ProtocolError, TimeoutError):
                    close = True
        if close and not answer.close:
            answer.headers.set("Connection", "close")
        self.write_answer(answer)
        return not close

    async def _forward_body(self, ex: Exchange, upstream: Upstream, size: int | None,
                            start: list[bytes], rest: Any,
                            trailers: list[list[tuple[bytes, bytes]]]) -> bool:
        """Stream a large request body through the exchange's scan."""
        chunked = size is None

        async def chunks() -> Any:
            for data in start:
                yield data
            async for data in rest:
                yield data

        try:
            async for data in chunks():
                out = ex.request_data(data)
                if out:
                    await upstream.send(b"%x\r\n%s\r\n" % (len(out), out) if chunked else out)
            tail = ex.request_end(trailers[0] if trailers else None)
        except Refusal as refusal:
            self.drop_upstream()  # the upstream has a partial request: never reuse it
            self.exchange = None
            self.write_answer(ex.abort(refusal))
            return False
        if tail:
            await upstream.send(b"%x\r\n%s\r\n" % (len(tail), tail) if chunked else tail)
        if chunked:
            fields = b"".join(k + b": " + v + b"\r\n" for k, v in (trailers[0] if trailers
                                                                   else []))
            await upstream.send(b"0\r\n" + fields + b"\r\n")
        return True

    async def _connect(self, ex: Exchange) -> Upstream | None:
        """The kept-alive upstream connection if it still serves this destination and
        is clean; else one this sandbox parked for it (`pool.py`); else a new one."""
        pinned = ex.pinned
        tls = ex.target.scheme == "https"
        key = (ex.identity.sandbox, pinned.address, pinned.host, tls)
        upstream = self.upstream
        if upstream is not None:
            if upstream.key == key and upstream.reusable():
                upstream.clean = False
                return upstream
            self.release_upstream()
        pool = self.engine.pool
        upstream = pool.take(key)
        if upstream is not None:
            return self._hold(upstream)
        timeouts = self.engine.timeouts
        try:
            upstream = await Upstream.open(
                pinned, self.engine.upstream_tls if tls else None,
                connect=timeouts.connect, handshake=timeouts.handshake, proxy=self.engine.proxy)
        except PhaseTimeout as exc:
            self._fail(ex, exc.phase, str(exc))
            return None
        except ProxyDialFailed as exc:
            self.exchange = None
            self.drop_upstream()
            self.write_answer(ex.upstream_proxy_failed(exc.failure.reason))
            return None
        except (OSError, ssl.SSLError) as exc:
            kind = "tls" if isinstance(exc, ssl.SSLError) else "connect"
            detail = getattr(exc, "verify_message", None) or getattr(exc, "strerror", None) \
                or type(exc).__name__
            self._fail(ex, kind, str(detail))
            return None
        except Exception:  # the dial's own check (pin) failed: never dial unchecked
            log.exception("dialling the upstream failed; refusing (fail closed)")
            self.exchange = None
            self.write_answer(ex.abort(Refusal(
                "forbidden_destination", "gateway error while checking the destination; "
                "the connection was not made (fail closed)")))
            return None
        upstream.key = key
        metrics.child(metrics.UPSTREAM_CONNECTIONS, "dialled").inc()
        return self._hold(upstream)

    def _hold(self, upstream: Upstream) -> Upstream:
        upstream.clean = False
        upstream.partner, self.partner = self, upstream
        self.upstream = upstream
        return upstream

    def _fail(self, ex: Exchange, kind: str, detail: str) -> None:
        self.exchange = None
        self.drop_upstream()
        self.write_answer(ex.upstream_failed(kind, detail))

    async def _response_head(self, ex: Exchange, upstream: Upstream
                             ) -> RawResponse | None:
        """The final response head (informational ones are not forwarded), or None
        when the upstream closed before sending any byte of one."""
        timeout = self.engine.timeouts.read
        while True:
            try:
                event = read_response_head(upstream.buf)
            except h11.ProtocolError as exc:
                raise ProtocolError(str(exc)) from None
            if event is not None:
                if event.status_code < 200 and event.status_code != 101:
                    continue  # 100 Continue, 103 Early Hints: not forwarded
                return event
            if upstream.eof:
                if len(upstream.buf):
                    raise ProtocolError("the upstream closed in the middle of a response head")
                return None
            await upstream.more(timeout, "response head")

    async def _relay_response(self, ex: Exchange, upstream: Upstream, request: RequestHead,
                              client_close: bool, replay: list[bytes] | None) -> bool:
        before = upstream.received
        try:
            event = await self._response_head(ex, upstream)
            if event is None and upstream.reused and upstream.received == before \
                    and replay is not None and request.method in IDEMPOTENT:
                # The upstream closed a kept-alive connection as we reused it: once more,
                # on a new connection (nothing of a response was seen, the request is
                # idempotent and kept).
                self.drop_upstream()
                retry = await self._connect(ex)
                if retry is None:
                    return False
                upstream = retry
                for part in replay:
                    await upstream.send(part)
                event = await self._response_head(ex, upstream)
            if event is None:
                self._fail(ex, "closed", "no response")
                return False
            head = framing.response_head(event)
        except ProtocolError as exc:
            self._fail(ex, "protocol", str(exc))
            return False
        except TimeoutError:
            self._fail(ex, "timeout", f"no response within {self.engine.timeouts.read:g}s")
            return False
        upstream.reused = True
        method = request.method
        size = framing.response_body_size(method, head)
        original_length = head.headers.get("content-length")
        try:
            head = ex.response(head)
        except Refusal as refusal:
            self.exchange = None
            self.drop_upstream()
            self.write_answer(ex.abort(refusal))
            return False
        if head.status == 101:
            return await self._upgrade(ex, upstream, head)
        http10 = request.http_version == "HTTP/1.0"
        # The client's connection closes when the client or a drain asks; an upstream's
        # `Connection: close` ends only the upstream connection (redialled next time).
        upstream_close = _wants_close(head.http_version, head.headers.get_all("connection"))
        close = client_close or self.engine.draining
        if no_body(method, head.status):
            chunked, length = False, (int(original_length) if original_length else None)
        elif size is not None and size >= 0 and head.headers.get("content-length") is not None:
            chunked, length = False, size
        else:
            chunked, length = not http10, None
            close = close or http10
        await self.send(framing.serialize_response(head, chunked=chunked, length=length,
                                                   close=close))
        trailers: list[list[tuple[bytes, bytes]]] = []
        try:
            whole = _buffered_body(upstream, size)
            if whole is not None:  # (a small answer's usual case: no reader to run)
                out = ex.response_data(whole) if whole else b""
                if out:
                    await self.send(b"%x\r\n%s\r\n" % (len(out), out) if chunked else out)
            else:
                async for data in self._body(upstream, size, self.engine.timeouts.read,
                                             trailers, "response body bytes"):
                    out = ex.response_data(data)
                    if out:
                        await self.send(b"%x\r\n%s\r\n" % (len(out), out) if chunked
                                        else out)
            tail = ex.response_end()
        except (ProtocolError, Refusal, TimeoutError) as exc:
            # The response is under way: the client cannot be told; close both sides.
            log.info("response from %s:%d cut off: %s", ex.target.host, ex.target.port,
                     error_phrase(str(exc)))
            self.exchange = None
            if isinstance(exc, Refusal):  # (audited as the refusal it is)
                ex.abort(exc)
            else:
                ex.finish(head.status, error="upstream_timeout"
                          if isinstance(exc, TimeoutError) else "upstream_failed")
            self.drop_upstream()
            return False
        if tail:
            await self.send(b"%x\r\n%s\r\n" % (len(tail), tail) if chunked else tail)
        if chunked:
            fields = trailers[0] if trailers else []
            redacted = ex.response_trailers(fields) if fields else []
            await self.send(b"0\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in redacted)
                            + b"\r\n")
        self.exchange = None
        ex.finish(head.status)
        if size == -1 or upstream_close:
            self.drop_upstream()
        elif len(upstream.buf):
            self.drop_upstream()  # more than the response framed: a confused upstream
        else:  # kept for the next request (a closing client's: parked, `_shutdown`)
            upstream.clean = True
            self.idle_since = time.monotonic()
        if close:
            self.flush()
        return not close

    async def _upgrade(self, ex: Exchange, upstream: Upstream, head: Any) -> bool:
        """A 101 to WebSocket: relay messages through the exchange until either side
        closes; the connection ends with the WebSocket."""
        self.upstream = None  # the connection now belongs to the upgrade
        try:
            if (head.headers.get("upgrade") or "").strip().lower() != "websocket" or \
                    (ex.head.headers.get("upgrade") or "").strip().lower() != "websocket":
                self.exchange = None
                self.write_answer(ex.upstream_failed(
                    "protocol", "the upstream switched to a protocol other than WebSocket"))
                return False
            await self.send(framing.serialize_response(head, chunked=False, length=None,
                                                       close=False, upgrade=True))
            await relay(self, upstream, ex, head, idle=self.engine.timeouts.client_idle,
                        limit=self.engine.limits.max_websocket_message)
            self.exchange = None
            ex.finish(101)
            return False
        finally:
            upstream.close()


def _buffered_body(side: Side, size: int | None) -> bytes | None:
    """A Content-Length body (`size` bytes, 0 for none) already whole in `side`'s
    buffer, taken out of it as `_body` would take it; None: `_body` reads it as it comes
    (chunked, until close, or not all here yet)."""
    if size is None or size < 0 or size > len(side.buf) or side.chunks:
        return None
    if size == 0:
        return b""
    event = ContentLengthReader(size)(side.buf)
    assert isinstance(event, h11.Data)  # (the buffer holds all `size` bytes)
    return bytes(event.data)


def _wants_close(version: str, connection: list[str]) -> bool:
    tokens = {t.strip().lower() for v in connection for t in v.split(",")}
    if version == "HTTP/1.0":
        return "keep-alive" not in tokens
    return "close" in tokens
