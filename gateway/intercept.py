"""The HTTP/1 intercept path: inspected tunnels served without mitmproxy's layer stack.

A CONNECT the policy allows *with* inspection (path or method rules, a credential,
`inspect: true`) whose ClientHello offers HTTP/1.1 (or no ALPN) is served here: the
gateway terminates TLS with its leaf certificate (`tls_memory`), parses each request
with mitmproxy's own HTTP/1 functions (the same head parser, body-size rules and
request-smuggling checks), and runs **the same addon chain** mitmproxy would — the
`requestheaders`, `request`, `responseheaders`, `response` and `error` hooks of
Identify, Enforce, LocalApi, Inject, Record … are called with a real
`mitmproxy.http.HTTPFlow`. Only the machinery around them (layers, commands, events,
pyOpenSSL) is replaced by one coroutine per tunnel and two memory-BIO TLS sessions.
The policy, the key swap, the leak checks and the audit line stay in one place.

The upstream connection goes to the address checked at CONNECT (pinned), verifies the
server certificate, is kept alive between requests and closed after
`network.upstream_idle_timeout` without a request. Request bodies up to 1 MiB are
buffered (and scanned whole by Inject), larger or chunked ones stream through Inject's
scanner; responses always stream. WebSocket upgrades are relayed by
`gateway.websocket_relay` with the WebSocket hooks. Anything the path does not speak
(HTTP/2-only clients, non-TLS bytes) never gets here: `gateway.fastpath` hands it to
mitmproxy. Any error closes the tunnel (fail closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import h11
from h11._readers import ChunkedReader, ContentLengthReader, Http10Reader
from h11._receivebuffer import ReceiveBuffer
from mitmproxy import connection, flow, http
from mitmproxy.addonmanager import AddonManager, traverse
from mitmproxy.net.http import http1, url
from mitmproxy.net.http.http1.read import _read_headers, _read_request_line, _read_response_line
from mitmproxy.net.http.validate import validate_headers
from mitmproxy.proxy.layers.http import HTTPMode, validate_request
from mitmproxy.websocket import WebSocketData

from gateway.addons.common import ClientSession, Sessions, Tunnel
from gateway.policy import Decision
from gateway.resolver import Pinned, pin
from gateway.tls_memory import LeafContexts, TlsClosed, TlsPump
from gateway.tokens import Identity
from gateway.upstream_errors import REFUSED_MARK, error_response
from gateway.websocket_relay import is_websocket, relay

log = logging.getLogger("sandbox_gateway")

MAX_HEAD = 64 * 1024
BUFFER_LIMIT = 1024 * 1024  # request bodies up to this size are buffered (stream_large_bodies)
HIGH_WATER = 1024 * 1024
CONNECT_TIMEOUT = 30.0  # seconds for the upstream's TCP connect and TLS handshake
OUT_LIMIT = 64 * 1024  # queued plaintext is encrypted and written at this size at the latest
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
HOOKS = ("client_connected", "client_disconnected", "requestheaders", "request",
         "responseheaders", "response", "error", "websocket_start", "websocket_message",
         "websocket_end")


class ProtocolError(Exception):
    """The peer sent something that is not valid HTTP/1 (answered 400 / 502, closed)."""


class Hooks:
    """The addon chain's hooks, called in chain order like mitmproxy's addon manager does
    (an exception is logged and the next addon runs; every enforcing hook is wrapped
    fail-closed, so a crash there refuses the flow). The lookup is redone only when
    addons are added or removed. `skip`: addons whose job the path does itself (closing
    idle upstreams of mitmproxy's connections)."""

    def __init__(self, manager: AddonManager, skip: tuple[type, ...] = ()) -> None:
        self.manager = manager
        self.skip = skip
        self._version: tuple[int, int] = (-1, 0)
        self._hooks: dict[str, tuple[Callable[..., Any], ...]] = {}

    def _lookup(self, name: str) -> tuple[Callable[..., Any], ...]:
        chain = self.manager.chain
        version = (len(chain), id(chain[-1]) if chain else 0)
        if version != self._version:
            addons = [a for a in traverse(chain) if not isinstance(a, self.skip)]
            self._hooks = {hook: tuple(f for a in addons if callable(f := getattr(a, hook, None)))
                           for hook in HOOKS}
            self._version = version
        return self._hooks[name]

    async def __call__(self, name: str, *args: Any) -> None:
        for hook in self._lookup(name):
            try:
                result = hook(*args)
                if result is not None and inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("addon hook %s failed", getattr(hook, "__qualname__", hook))


class Engine:
    """What every intercepted tunnel shares."""

    def __init__(self, hooks: Hooks, sessions: Sessions, leaves: LeafContexts,
                 upstream_tls: ssl.SSLContext, idle_timeout: float) -> None:
        self.hooks = hooks
        self.sessions = sessions
        self.leaves = leaves
        self.upstream_tls = upstream_tls
        self.idle_timeout = idle_timeout
        self.tunnels: set[InterceptedTunnel] = set()
        self._sweeper: asyncio.Task[None] | None = None

    def add(self, tunnel: InterceptedTunnel) -> None:
        self.tunnels.add(tunnel)
        if self._sweeper is None and self.idle_timeout > 0:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        """Close the upstream half of tunnels idle for `idle_timeout` (one timer for all
        tunnels, not one per request)."""
        while True:
            await asyncio.sleep(max(0.25, self.idle_timeout / 4))
            deadline = time.monotonic() - self.idle_timeout
            for tunnel in list(self.tunnels):
                if tunnel.upstream is not None and tunnel.idle_since is not None \
                        and tunnel.idle_since <= deadline:
                    tunnel._drop_upstream()

    def close_all(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for tunnel in list(self.tunnels):
            tunnel.close()


class _Side(asyncio.Protocol):
    """One TLS connection (sandbox or upstream): plaintext lands in a receive buffer
    that the tunnel's coroutine reads. Writes are gathered and encrypted together
    when the coroutine is about to wait for either side (a small exchange costs one
    TLS record and one write per direction) or once 64 KiB are pending, and honour
    the transport's flow control."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.tls: TlsPump | None = None
        self.buf = ReceiveBuffer()
        self.eof = False
        self.error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._drain: asyncio.Future[None] | None = None
        self._paused = False
        self._out: list[bytes | memoryview] = []
        self._out_size = 0
        self.partner: _Side | None = None  # the other side of the tunnel

    # transport events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=HIGH_WATER)

    def data_received(self, data: bytes) -> None:
        assert self.tls is not None
        try:
            plain = self.tls.feed(data)
        except (TlsClosed, ssl.SSLError) as exc:
            self._end(exc)
            return
        if plain:
            self.buf += plain
            if len(self.buf) > HIGH_WATER and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool | None:
        self._end(None)
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(exc)
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def pause_writing(self) -> None:
        self._drain = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    def _end(self, exc: BaseException | None) -> None:
        self.eof = True
        if exc is not None and self.error is None and not isinstance(exc, TlsClosed):
            self.error = exc
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # for the coroutine
    async def more(self) -> None:
        """Wait for more plaintext (or the end); what both sides gathered goes out first."""
        self.flush()
        if self.partner is not None:
            self.partner.flush()
        if self.eof:
            return
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter

    async def send(self, data: bytes | memoryview) -> None:
        """Queue plaintext for this side (see the class docstring for when it goes)."""
        if self.tls is None or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("connection closed")
        self._out.append(data)
        self._out_size += len(data)
        if self._out_size >= OUT_LIMIT:
            self.flush()
            if self._drain is not None:
                await self._drain

    def flush(self) -> None:
        """Encrypt and write what is queued."""
        if not self._out:
            return
        out, self._out, self._out_size = self._out, [], 0
        if self.tls is not None and self.transport is not None \
                and not self.transport.is_closing():
            self.tls.send(out[0] if len(out) == 1 else b"".join(out))

    def write_raw(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    async def read_head(self) -> list[bytes] | None:
        """The next message head's lines; None at a clean end before one started."""
        while True:
            lines = self.buf.maybe_extract_lines()
            if lines:
                return [bytes(line) for line in lines]
            if len(self.buf) > MAX_HEAD:
                raise ProtocolError("message head too large")
            if self.eof:
                if len(self.buf):
                    raise ProtocolError("connection closed in the middle of a message head")
                return None
            await self.more()

    async def body(self, size: int | None) -> AsyncIterator[bytes]:
        """A message body, framed by `size` (expected_http_body_size): chunks as they
        arrive, de-chunked."""
        if size == 0:
            return
        reader: Any = (ChunkedReader() if size is None else Http10Reader() if size == -1
                       else ContentLengthReader(size))
        while True:
            try:
                event = reader(self.buf)
                if event is None and self.eof:
                    event = reader.read_eof()
            except h11.ProtocolError as exc:
                raise ProtocolError(f"bad message body: {exc}") from None
            if event is None:
                await self.more()
            elif isinstance(event, h11.Data):
                if event.data:
                    yield bytes(event.data)
            else:  # EndOfMessage (trailers are not forwarded)
                return

    def close(self) -> None:
        self.flush()
        if self.transport is not None and not self.transport.is_closing():
            if self.tls is not None and self.tls.established:
                self.tls.close()
            self.transport.close()


class _Upstream(_Side):
    """The upstream half: dialled to the pinned address, server certificate verified."""

    @classmethod
    async def open(cls, engine: Engine, pinned: Pinned) -> _Upstream:
        side = cls()
        pin(pinned)  # the address dialled is the one that was checked
        ip, port = pinned.address
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):  # TimeoutError is an OSError
                await loop.create_connection(lambda: side, ip, port)
                assert side.transport is not None
                side.tls = TlsPump(engine.upstream_tls, side.write_raw, server_side=False,
                                   server_hostname=pinned.host)
                side.tls.start()
                while not side.tls.established:
                    if side.eof:
                        raise side.error or ConnectionResetError("upstream closed during TLS")
                    await side.more()
        except BaseException:
            side.close()
            raise
        return side


class InterceptedTunnel(_Side):
    """The sandbox side of one intercepted tunnel, and the coroutine that serves it."""

    def __init__(self, engine: Engine, identity: Identity, token: str, decision: Decision,
                 pinned: Pinned, peer: tuple[str, int], sock: tuple[str, int],
                 sni: str | None) -> None:
        super().__init__()
        self.engine = engine
        self.pinned = pinned
        self.upstream: _Upstream | None = None
        self.idle_since: float | None = None  # monotonic end of the last exchange
        self.client = connection.Client(peername=peer, sockname=sock,
                                        timestamp_start=time.time())
        self.client.sni = sni
        self.client.tls = True
        self.client.alpn = b"http/1.1"
        self.session = ClientSession(identity, token, Tunnel(pinned.host, pinned.port, decision,
                                                             passthrough=False))
        self.server = connection.Server(address=(pinned.host, pinned.port))
        self.task: asyncio.Task[None] | None = None

    def start(self, transport: asyncio.Transport, first: bytes) -> None:
        """Take over `transport` (answered 200 already); `first` holds the ClientHello."""
        self.connection_made(transport)
        self.tls = TlsPump(self.engine.leaves.get(self.pinned.host), self.write_raw,
                           server_side=True)
        transport.set_protocol(self)
        self.engine.add(self)
        self.task = asyncio.get_running_loop().create_task(self._serve())
        if first:
            self.data_received(first)

    async def _serve(self) -> None:
        hooks = self.engine.hooks
        # What Identify/Enforce know about this connection (dropped by Record on disconnect).
        self.engine.sessions.put(self.client, self.session)
        await hooks("client_connected", self.client)
        try:
            while True:
                lines = await self.read_head()
                if lines is None or not await self._exchange(lines):
                    break
        except ProtocolError as exc:
            self.write_error(400, str(exc))
        except (ConnectionError, TlsClosed, ssl.SSLError, asyncio.CancelledError):
            pass
        except Exception:
            log.exception("intercepted tunnel failed; closing (fail closed)")
        finally:
            self._shutdown()
            await hooks("client_disconnected", self.client)

    def write_error(self, status: int, message: str) -> None:
        if self.tls is not None and self.tls.established:
            self.flush()
            with contextlib.suppress(ssl.SSLError):
                self.tls.send(error_response(status, message))

    def _shutdown(self) -> None:
        self.engine.tunnels.discard(self)
        if self.upstream is not None:
            self.upstream.close()
            self.upstream = None
        super().close()

    def close(self) -> None:
        """Close both sides (shutdown)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
        self._shutdown()


    # -- one request/response --------------------------------------------------------

    async def _exchange(self, lines: list[bytes]) -> bool:
        """Serve one request; True to keep the connection for the next one."""
        self.idle_since = None
        try:
            request = _request_head(lines)
            size = http1.expected_http_body_size(request)
        except ValueError as exc:
            raise ProtocolError(f"the request could not be parsed: {exc}") from None
        invalid = validate_request(HTTPMode.regular, request, True)
        if invalid is not None or request.method == "CONNECT":
            raise ProtocolError(invalid or "CONNECT inside a tunnel")
        host_header = request.host_header
        if not host_header:
            raise ProtocolError("the request has no Host header")
        try:
            host, port = url.parse_authority(host_header, check=True)
        except ValueError:
            raise ProtocolError(f"invalid Host header {host_header[:100]!r}") from None
        request.data.host = host
        request.data.port = port or 443
        request.scheme = "https"
        request.authority = ""

        f = http.HTTPFlow(self.client, self.server)
        f.request = request
        f.live = True
        hooks = self.engine.hooks
        streaming = size is None or size == -1 or size > BUFFER_LIMIT
        if streaming:
            request.stream = True
        await hooks("requestheaders", f)
        if _killed(f):
            return False
        if f.response is not None:
            return await self._answer_locally(f, size)
        if request.headers.get("expect", "").lower() == "100-continue":
            request.headers.pop("expect")
            await self.send(CONTINUE)

        body = b""
        if size == 0:
            request.stream = False  # nothing to stream: buffered path, one write upstream
        if not request.stream:
            body = b"".join([chunk async for chunk in self.body(size)])
            request.data.content = body
            request.timestamp_end = time.time()
            await hooks("request", f)
            if _killed(f):
                return False
            if f.response is not None:
                return await self._send_local(f)
            body = request.raw_content or b""

        upstream = await self._connect(f)
        if upstream is None:
            return False
        head = http1.assemble_request_head(request)
        chunked_up = "chunked" in request.headers.get("transfer-encoding", "").lower()
        if request.stream:
            await upstream.send(head)
            if not await self._stream_request(f, upstream, size, chunked_up):
                return False
        else:
            await upstream.send(head + body if body else head)

        return await self._relay_response(f, upstream, request)

    async def _stream_request(self, f: http.HTTPFlow, upstream: _Upstream, size: int | None,
                              chunked: bool) -> bool:
        request = f.request
        transform = request.stream if callable(request.stream) else None
        async for data in self.body(size):
            chunks = transform(data) if transform is not None else data
            if _killed(f):
                return False
            await _send_body(upstream, chunks, chunked)
        if transform is not None:
            tail = transform(b"")
            if _killed(f):
                return False
            await _send_body(upstream, tail, chunked)
        if chunked:
            await upstream.send(b"0\r\n\r\n")
        request.timestamp_end = time.time()
        await self.engine.hooks("request", f)
        return not _killed(f)

    async def _answer_locally(self, f: http.HTTPFlow, size: int | None) -> bool:
        """A hook answered (a refusal or the local API): drop the request body, reply.
        A client waiting for `100 Continue` never sends its body: answer and close."""
        if size != 0 and f.request.headers.get("expect", "").lower() == "100-continue":
            assert f.response is not None
            f.response.headers["connection"] = "close"
            await self._send_local(f)
            return False
        received = 0
        async for chunk in self.body(size):
            received += len(chunk)
            if received > 8 * BUFFER_LIMIT:
                await self._send_local(f)
                return False
        f.request.timestamp_end = time.time()
        return await self._send_local(f)

    async def _send_local(self, f: http.HTTPFlow) -> bool:
        assert f.response is not None
        hooks = self.engine.hooks
        f.response.timestamp_start = time.time()
        await hooks("responseheaders", f)
        if _killed(f):
            return False
        response = f.response
        assert response is not None
        await self.send(http1.assemble_response(response))
        response.timestamp_end = time.time()
        await hooks("response", f)
        return not http1.connection_close(f.request.http_version, f.request.headers)

    async def _connect(self, f: http.HTTPFlow) -> _Upstream | None:
        upstream = self.upstream
        if upstream is not None and not upstream.eof and not len(upstream.buf):
            return upstream  # (bytes nobody asked for mean a confused upstream: redial)
        if upstream is not None:
            upstream.close()
        self.upstream = None
        try:
            upstream = self.upstream = await _Upstream.open(self.engine, self.pinned)
            upstream.partner, self.partner = self, upstream
        except (OSError, ssl.SSLError) as exc:
            reason = getattr(exc, "verify_message", None) or exc.strerror or str(exc)
            await self._upstream_failed(f, f"{self.pinned.host}:{self.pinned.port}: {reason}")
            return None
        except Exception:
            log.exception("dialling the upstream failed; refusing (fail closed)")
            await self._upstream_failed(
                f, f"{REFUSED_MARK}gateway error while connecting to the destination")
            return None
        self.server.timestamp_start = time.time()
        return upstream

    async def _upstream_failed(self, f: http.HTTPFlow, message: str) -> None:
        f.error = flow.Error(message)
        f.live = False
        await self.engine.hooks("error", f)
        if f.response is None:
            self.write_error(502, message)

    async def _relay_response(self, f: http.HTTPFlow, upstream: _Upstream,
                              request: http.Request) -> bool:
        hooks = self.engine.hooks
        try:
            while True:
                lines = await upstream.read_head()
                if lines is None:
                    raise ProtocolError("the upstream closed the connection without a response")
                response = _response_head(lines)
                if response.status_code == 101 or not 100 <= response.status_code < 200:
                    break  # informational answers (100 Continue, 103) are not forwarded
            size = http1.expected_http_body_size(request, response)
            validate_headers(response)
        except ValueError as exc:
            self._drop_upstream()
            await self._upstream_failed(f, f"the upstream sent an invalid response: {exc}")
            return False
        except ProtocolError as exc:
            self._drop_upstream()
            await self._upstream_failed(f, str(exc))
            return False
        f.response = response
        await hooks("responseheaders", f)
        if _killed(f):
            self._drop_upstream()
            return False
        assert f.response is not None
        response = f.response
        if response.status_code == 101:
            return await self._upgrade(f, upstream)
        await self.send(http1.assemble_response_head(response))
        chunked = size != 0 and "chunked" in response.headers.get(
            "transfer-encoding", "").lower()
        transform = response.stream if callable(response.stream) else None
        try:
            async for data in upstream.body(size):
                await _send_body(self, transform(data) if transform else data, chunked)
        except ProtocolError as exc:
            self._drop_upstream()
            f.error = flow.Error(str(exc))
            await hooks("error", f)
            return False
        if transform is not None:
            await _send_body(self, transform(b""), chunked)
        if chunked:
            await self.send(b"0\r\n\r\n")
        response.timestamp_end = time.time()
        await hooks("response", f)
        close = (size == -1 or http1.connection_close(request.http_version, request.headers)
                 or http1.connection_close(response.http_version, response.headers))
        if close:
            self._drop_upstream()
            return False
        if len(upstream.buf):
            self._drop_upstream()  # more than the response framed (a HEAD answered with a body)
        self.idle_since = time.monotonic()
        return True

    async def _upgrade(self, f: http.HTTPFlow, upstream: _Upstream) -> bool:
        """A 101: WebSocket is relayed message by message; any other protocol is refused
        (its bytes could not be inspected)."""
        self.upstream = None  # the connection now belongs to the upgrade
        try:
            if not is_websocket(f):
                f.error = flow.Error("refused: upgrade to a protocol other than WebSocket")
                await self.engine.hooks("error", f)
                self.write_error(502, "the upstream switched to a protocol other than "
                                 "WebSocket, which the gateway cannot inspect")
                return False
            f.websocket = WebSocketData()
            await self.engine.hooks("response", f)
            if _killed(f) or f.response is None:
                return False
            await self.send(http1.assemble_response_head(f.response))
            await relay(self, upstream, f)
            return False
        finally:
            upstream.close()

    def _drop_upstream(self) -> None:
        if self.upstream is not None:
            self.upstream.close()
            self.upstream = self.partner = None


async def _send_body(side: _Side, chunks: bytes | Iterable[bytes], chunked: bool) -> None:
    """Body chunks (what a stream filter returned) out, chunk-encoded if `chunked`."""
    for chunk in [chunks] if isinstance(chunks, bytes) else chunks:
        if chunk:
            await side.send(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)


def _request_head(lines: list[bytes]) -> http.Request:
    """`http1.read_request_head` (mitmproxy's own parser and checks) without the
    per-field type check `MessageData.__post_init__` runs in debug mode, which costs
    more than the parsing: the parser's return types are the fields' types."""
    host, port, method, scheme, authority, path, version = _read_request_line(lines[0])
    data = http.RequestData.__new__(http.RequestData)
    data.__dict__.update(
        host=host, port=port, method=method, scheme=scheme, authority=authority, path=path,
        http_version=version, headers=_read_headers(lines[1:]), content=None,
        trailers=None, timestamp_start=time.time(), timestamp_end=None)
    request = http.Request.__new__(http.Request)
    request.data = data
    return request


def _response_head(lines: list[bytes]) -> http.Response:
    """`http1.read_response_head`, likewise."""
    version, status_code, reason = _read_response_line(lines[0])
    data = http.ResponseData.__new__(http.ResponseData)
    data.__dict__.update(
        http_version=version, status_code=status_code, reason=reason,
        headers=_read_headers(lines[1:]), content=None, trailers=None,
        timestamp_start=time.time(), timestamp_end=None)
    response = http.Response.__new__(http.Response)
    response.data = data
    return response


def _killed(f: http.HTTPFlow) -> bool:
    return f.error is not None and f.error.msg == flow.Error.KILLED_MESSAGE


