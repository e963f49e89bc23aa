"""The mitmproxy engine: mitmproxy's flows translated into calls to the gate.

mitmproxy serves what the gateway's own engines do not: HTTP/2 (tunnels whose
ClientHello offers only h2, handed over by the doors with the client already
admitted), and everything when `network.intercept: mitmproxy` runs it as the only
engine (CONNECT, plain proxy requests, passthrough, HTTP/1, HTTP/2, WebSocket,
transparent mode). This adapter is the one addon that talks to the gate: it turns
`HTTPFlow`s into `RequestHead`s and answers into responses, and decides nothing.

**Fail closed, at one boundary.** mitmproxy logs and swallows exceptions raised in
addon hooks (a crash in `http_connect` would answer 200, in `requestheaders` forward
the request, in `server_connect` dial anyway). Every hook of this adapter is installed
through `_guarded`, which turns any exception into a refusal of what the hook was
handling; no hook can be added without it. **Only an admitted destination is
dialled**: `server_connect` pins the address the gate checked for that client and
refuses any other.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import secrets
import time
import weakref
from collections.abc import Callable
from typing import Any

from mitmproxy import connection, http, tcp
from mitmproxy.proxy import server_hooks

from gateway.core.messages import Headers, RequestHead, ResponseHead
from gateway.core.names import DestinationError, normalize_host
from gateway.core.phrases import error_phrase
from gateway.core.refusal import (
    GATEWAY_ERROR,
    Answer,
    MessageRefused,
    Refusal,
    answer,
    to_http1,
)
from gateway.engines import patches
from gateway.engines.first_bytes import FirstBytes, classify
from gateway.engines.patches import (
    NextLayerAddon,
    raw_authority,
    raw_method,
)
from gateway.net.resolver import Pinned, pin, route_pinned_dial
from gateway.net.tls import TICKET_KEY_LIFETIME
from gateway.net.upstream_proxy import MARK as PROXY_MARK
from gateway.net.upstream_proxy import UpstreamProxy, dialer
from gateway.pipeline.exchange import BODY_HOLD_LIMIT, Exchange, no_body
from gateway.pipeline.exchange_response import upstream_refusal
from gateway.pipeline.gate import Client, Gate, Refused

log = logging.getLogger("sandbox_gateway")

EXCHANGE = "sandbox_gateway.exchange"
REFUSED_MARK = f"refused [{secrets.token_hex(8)}]: "  # our server_connect refusals
BACKSTOP_MARK = "[Errno 13] sandbox-gateway refused"
TIMED_OUT_MARK = f"timed out [{secrets.token_hex(8)}]: "  # our dial and handshake timers
STREAM_LARGE_BODIES = BODY_HOLD_LIMIT  # mitmproxy buffers bodies up to this itself;
# the adapter streams (and scans chunk by chunk) anything over an exchange's hold limit
ANSWERED = "sandbox_gateway.answered"


def error_page(status: int, message: str) -> bytes:
    """mitmproxy's own HTTP/1 error answers (upstream unreachable, bad request), in the
    gateway's shape. The message can quote what the upstream sent (an echoed key among
    it): the log gets its words up to the quote, the answer only what kind of failure
    it was."""
    return to_http1(answer(_page_refusal(status, message), close=True))


def error_h2(status: int, message: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """mitmproxy's HTTP/2 error answers, likewise: (status, fields, body)."""
    ans = answer(_page_refusal(status, message))
    fields = [(k.lower(), v) for k, v in ans.headers.fields
              if k.lower() not in (b"connection", b"content-length")]
    return ans.status, fields, ans.body


def _page_refusal(status: int, message: str) -> Refusal:
    # Only a message that *starts* with the gateway's own words is quoted: mitmproxy puts
    # upstream bytes in other messages, and those could hold anything after a marker.
    # server_connect refusals carry a per-process nonce an upstream cannot guess.
    for prefix in (REFUSED_MARK, f"Connection killed: {REFUSED_MARK}"):
        if message.startswith(prefix):
            return Refusal("forbidden_destination", message[len(prefix):][:300])
    if message.startswith(PROXY_MARK):  # the upstream proxy's dial (fixed sentences)
        return Refusal("upstream_proxy_failed", message[len(PROXY_MARK):][:300])
    if message.startswith(BACKSTOP_MARK):  # the event loop's backstop (PermissionError)
        return Refusal("forbidden_destination", message[len("[Errno 13] "):][:300])
    timed_out = _timed_out(message)
    if timed_out is not None:  # as the HTTP/1 engine words it (upstream_failed, its phase)
        kind, where, detail = timed_out
        return upstream_refusal(kind, detail, where)
    log.info("mitmproxy answered %d: %s", status, error_phrase(message))
    if status == 400:
        return Refusal("bad_request", "the request could not be parsed as HTTP")
    if status == 504:
        return Refusal("upstream_timeout", "the upstream did not answer in time")
    if status >= 500:
        return Refusal("upstream_failed", "the upstream could not be reached or answered "
                       "with something that is not valid HTTP; check that it is up and, for "
                       "TLS, that its certificate is valid (network.upstream_ca adds CAs)")
    return Refusal("gateway_error", "the gateway could not serve this request")


def timed_out_error(kind: str, where: str, detail: str) -> str:
    """The error text of a dial or TLS handshake our timers ended (`kind`: connect or
    tls_handshake, as the HTTP/1 engine names the phases), read back by `_timed_out`."""
    return f"{TIMED_OUT_MARK}{kind} {where} {detail}"


def _timed_out(message: str) -> tuple[str, str, str] | None:
    """(kind, where, detail) of a `timed_out_error` (mitmproxy may put words in front)."""
    for prefix in (TIMED_OUT_MARK, f"Connection killed: {TIMED_OUT_MARK}"):
        if message.startswith(prefix):
            kind, _, rest = message[len(prefix):].partition(" ")
            where, _, detail = rest.partition(" ")
            return kind, where, detail[:200]
    return None


def handshake_error(where: str, seconds: float) -> str:
    """patches.install_upstream_timeouts: a server TLS handshake that took too long."""
    return timed_out_error("tls_handshake", where, f"TCP connected but no TLS handshake "
                           f"within {seconds:g}s (network.timeouts.handshake)")


def _timed_dial(pinned: Pinned, seconds: float, where: str
                ) -> Callable[[Any, Callable[[], Any]], Any]:
    """mitmproxy's direct dial of `pinned` (through the loop's pinned-dial route),
    bounded by network.timeouts.connect: mitmproxy bounds it by nothing."""
    async def dial(loop: Any, factory: Callable[[], Any]) -> Any:
        ip, port = pinned.address
        try:
            async with asyncio.timeout(seconds) as limit:
                return await loop.create_connection(factory, ip, port)
        except TimeoutError:
            if not limit.expired():
                raise  # the OS's own (ETIMEDOUT)
            raise TimeoutError(timed_out_error(
                "connect", where, f"no TCP connection within {seconds:g}s "
                "(network.timeouts.connect)")) from None

    return dial


def to_response(ans: Answer) -> http.Response:
    response = http.Response.make(ans.status, ans.body, ans.headers.fields)
    response.reason = ans.reason
    return response


def _refuse_target(target: object) -> None:
    """What a failed hook leaves behind: a refusal of the thing it was handling."""
    if isinstance(target, http.HTTPFlow):
        if target.response is None:
            target.response = to_response(answer(GATEWAY_ERROR, close=True))
            target.metadata[ANSWERED] = True
        elif target.killable:
            target.kill()  # an upstream response is under way: cut it off
    elif isinstance(target, server_hooks.ServerConnectionHookData):
        target.server.error = REFUSED_MARK + "gateway error while checking the destination"
    elif patches.is_next_layer(target):
        target.layer = patches.refuse_layer(target.context,  # type: ignore[attr-defined]
                                            "gateway error while choosing the layer")
    elif isinstance(target, tcp.TCPFlow):
        target.kill()


def _guarded(hook: Callable[..., Any]) -> Callable[..., Any]:
    """The adapter's one fail-closed boundary (see the module docstring)."""
    if inspect.iscoroutinefunction(hook):
        @functools.wraps(hook)
        async def async_wrapper(self: Adapter, target: object) -> None:
            try:
                await hook(self, target)
            except Exception:
                log.exception("mitmproxy hook %s failed; refusing (fail closed)", hook.__name__)
                _refuse_target(target)

        return async_wrapper

    @functools.wraps(hook)
    def wrapper(self: Adapter, target: object) -> None:
        try:
            hook(self, target)
        except Exception:
            log.exception("mitmproxy hook %s failed; refusing (fail closed)", hook.__name__)
            _refuse_target(target)

    return wrapper


class Adapter(NextLayerAddon):
    """See the module docstring. Also mitmproxy's layer chooser (`nextlayer`): the
    gate's passthrough decision must come before mitmproxy picks TLS interception."""

    name = "nextlayer"  # proxyserver looks the layer chooser up by this name

    def __init__(self, gate: Gate, handoffs: dict[tuple[str, int], Client], *,
                 proxy: UpstreamProxy | None = None, connect_timeout: float = 10.0,
                 read_timeout: float = 300.0) -> None:
        super().__init__()
        self.gate = gate
        self.proxy = proxy  # network.upstream_proxy: mitmproxy's dials go through it
        # network.timeouts, for upstreams (the handshake's: an option of this gateway's
        # mitmproxy, `patches.add_handshake_option`, read by its TLS layer)
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        # (one for every flow: patches.install_upstream_timeouts reads it)
        self.read_wait = patches.ReadTimeout(read_timeout, self._read_timed_out,
                                             self._body_timed_out)
        self.tunnel_errors: dict[str, str] = {}  # client id -> why its tunnel's dial failed
        self.handoffs = handoffs
        self.clients: dict[str, Client] = {}
        self.exchanges: set[Exchange] = set()  # in flight (what a drain waits for)
        self.proxyserver: Any = None  # mitmproxy's Proxyserver addon (injects messages)
        # mitmproxy's client-facing TLS contexts are shared (cached by their options), so
        # their session tickets resume across connections; replaced every
        # `ticket_key_lifetime` seconds (new contexts draw new ticket keys), as the HTTP/1
        # engine replaces its front context.
        self.ticket_key_lifetime = TICKET_KEY_LIFETIME
        self._tickets_since = time.monotonic()

    def in_flight(self) -> int:
        self.exchanges = {ex for ex in self.exchanges if not ex.done}
        return len(self.exchanges)

    def _client(self, conn: connection.Client) -> Client:
        client = self.clients.get(conn.id)
        if client is None:  # not seen connecting (cannot happen): a fresh, unknown client
            client = self.clients[conn.id] = self._new_client(conn)
        return client

    def _new_client(self, conn: connection.Client) -> Client:
        peer = conn.peername or ("?", 0)
        key = (str(peer[0]), int(peer[1]))
        handed = self.handoffs.pop(key, None)
        if handed is not None:
            return handed
        transparent = conn.proxy_mode.type_name == "transparent"
        client = Client(key, "transparent" if transparent else "proxy", "mitmproxy",
                        end=lambda: self._end(conn.id))
        try:
            self.gate.opened(client)
        except Refused as refused:
            conn.error = refused.refusal.reason  # mitmproxy closes the connection
        return client

    def _end(self, client_id: str) -> None:
        if self.proxyserver is not None:
            patches.close_mitmproxy_connection(self.proxyserver, client_id)

    # -- connections -----------------------------------------------------------------------

    def _on_client_connected(self, conn: connection.Client) -> None:
        self.clients[conn.id] = self._new_client(conn)
        now = time.monotonic()
        if now - self._tickets_since >= self.ticket_key_lifetime:
            patches.replace_client_tls_contexts()
            self._tickets_since = now

    def _on_client_disconnected(self, conn: connection.Client) -> None:
        client = self.clients.pop(conn.id, None)
        error = self.tunnel_errors.pop(conn.id, None)
        if client is not None:
            try:
                self.gate.tunnel_closed(client, None, None, error)
            finally:
                self.gate.closed(client)

    async def _on_http_connect(self, flow: http.HTTPFlow) -> None:
        client = self._client(flow.client_conn)
        if client.tunnel is not None:
            return  # admitted by a door before the hand-off; mitmproxy's 200 is dropped
        auth = flow.request.headers.get("Proxy-Authorization")
        authority = flow.request.authority or f"{flow.request.host}:{flow.request.port}"
        try:
            await self.gate.connect(client, authority, auth)
        except Refused as refused:
            flow.response = to_response(refused.answer)
            flow.metadata[ANSWERED] = True

    async def _on_next_layer(self, nextlayer: Any) -> None:
        if nextlayer.layer is not None:
            return
        context = nextlayer.context
        if patches.tunnel_start(context):
            client = self._client(context.client)
            tunnel = client.tunnel
            if tunnel is None:
                nextlayer.layer = patches.refuse_layer(context, "tunnel without a decision")
                return
            if tunnel.tcp:
                nextlayer.layer = patches.passthrough_layer(context)
                return
            first = classify(nextlayer.data_client(), http=False)
            if first is None:
                return  # wait for the whole ClientHello
            try:
                self.gate.check_hello(client, first.name, tls=first.kind == "tls")
            except Refused as refused:
                nextlayer.layer = patches.refuse_layer(context, refused.refusal.reason)
                return
            if tunnel.passthrough:
                nextlayer.layer = patches.passthrough_layer(context)
                return
        elif patches.transparent_start(context):
            client = self._client(context.client)
            if client.tunnel is None:
                first = classify(nextlayer.data_client())
                if first is None:
                    return
                if not await self._admit_transparent(nextlayer, client, first):
                    return
            assert client.tunnel is not None
            if client.tunnel.passthrough:
                nextlayer.layer = patches.passthrough_layer(context)
                return
        NextLayerAddon.next_layer(self, nextlayer)  # mitmproxy's own choice (TLS, HTTP)

    async def _admit_transparent(self, nextlayer: Any, client: Client,
                                 first: FirstBytes) -> bool:
        context = nextlayer.context
        assert context.server.address is not None
        orig = (normalize_host(str(context.server.address[0])),
                int(context.server.address[1]))
        try:
            if client.identity is None:
                self.gate.identify_registered(client, orig)
            await self.gate.open_transparent(client, orig, first.kind, first.name)
        except Refused as refused:  # (audited by the gate)
            nextlayer.layer = patches.refuse_layer(context, refused.refusal.reason)
            return False
        return True

    # -- requests ------------------------------------------------------------------------

    async def _on_requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        client = self._client(flow.client_conn)
        req = flow.request
        auth = req.headers.get("Proxy-Authorization")
        h2 = req.is_http2 or req.is_http3
        if h2:
            target, authority, scheme = req.path, req.authority or None, req.scheme
        elif raw_authority(req):  # absolute-form inside a tunnel
            target = f"{req.scheme}://{req.authority}{req.path}"
            authority, scheme = None, None
        elif client.tunnel is None and client.listener == "proxy":
            # A plain proxy request: mitmproxy already cut its absolute URL down to
            # origin-form (keeping host and port): the gate sees the URL it named.
            host = f"[{req.host}]" if ":" in req.host else req.host
            default = 443 if req.scheme == "https" else 80
            target = (f"{req.scheme}://{host}{'' if req.port == default else f':{req.port}'}"
                      f"{req.path}")
            authority, scheme = None, None
        else:
            target, authority, scheme = req.path, None, None
        method = raw_method(req)  # (as sent: "get" is not "GET")
        head = RequestHead(method, target, Headers(req.headers.fields),
                           "HTTP/2.0" if h2 else req.http_version, authority, scheme)
        result = await self.gate.begin(client, head, tls=flow.client_conn.tls_established,
                                       proxy_authorization=auth)
        if isinstance(result, Answer):
            flow.response = to_response(result)
            flow.metadata[ANSWERED] = True
            return
        ex = result
        flow.metadata[EXCHANGE] = ex
        flow.metadata[patches.READ_TIMEOUT] = self.read_wait
        self.exchanges.add(ex)
        req.headers.fields = tuple(ex.head.headers.fields)
        req.path = ex.head.target
        if not h2:
            req.authority = ""  # forwarded origin-form, built from the target
        # The exchange's hold limit (the core's): a body that ends within it is checked
        # whole before anything goes out; mitmproxy buffers one of known length itself.
        length = req.headers.get("content-length")
        limit = ex.hold_limit
        if length is not None and length.isdigit() and int(length) <= limit:
            return  # buffered: `request` checks it whole
        if length is None and not h2 and "transfer-encoding" not in req.headers:
            return  # HTTP/1 without framing has no body: `request` admits it
        # Of unknown size (chunked, HTTP/2 without Content-Length) or over the limit: it
        # streams. mitmproxy sends the head before the body, so what needs the body
        # whole (a model in it, metering, a signature over it) is refused here, before
        # anything goes out: this engine cannot hold a body of unknown size.
        try:
            ex.streaming()
        except Refusal as refusal:
            flow.response = to_response(ex.abort(refusal))
            flow.metadata[ANSWERED] = True
            return
        # Of unknown or large size: scanned chunk by chunk as it streams (mitmproxy
        # would otherwise switch to streaming past its own limit after this hook,
        # unscanned).
        req.stream = _RequestStream(ex, flow, self.proxyserver)

    async def _on_request(self, flow: http.HTTPFlow) -> None:
        """A buffered body: checked whole before anything is sent upstream (held, in
        ask mode, while a person decides about a model the allowlist refuses)."""
        ex: Exchange | None = flow.metadata.get(EXCHANGE)
        if ex is None or flow.response is not None:
            return
        stream = flow.request.stream
        if isinstance(stream, _RequestStream) and stream.started:
            return  # checked chunk by chunk as it streamed
        trailers = flow.request.trailers
        try:
            body = await ex.request_decided(flow.request.raw_content or b"",
                                            list(trailers.fields) if trailers else None)
            if ex.head_changed:  # signed (SigV4) now that the body is known
                flow.request.headers.fields = tuple(ex.head.headers.fields)
            if body != (flow.request.raw_content or b""):
                flow.request.raw_content = body  # usage asked for on a stream; an MCP relay
                if "content-length" in flow.request.headers:
                    flow.request.headers["content-length"] = str(len(body))
        except Refusal as refusal:
            flow.response = to_response(ex.abort(refusal))
            flow.metadata[ANSWERED] = True
            return
        _forwardable_trailers(flow)

    def _read_timed_out(self, flow: http.HTTPFlow) -> http.Response:
        """The answer to a request whose response head did not come within
        network.timeouts.read (patches.install_upstream_timeouts), audited; called by
        mitmproxy's layers, outside any hook: fails closed here."""
        flow.metadata[ANSWERED] = True
        ex: Exchange | None = flow.metadata.get(EXCHANGE)
        detail = f"no response within {self.read_timeout:g}s"
        try:
            if ex is not None and not ex.done:
                return to_response(ex.upstream_failed("timeout", detail))
            return to_response(answer(upstream_refusal("timeout", detail, "?"), close=True))
        except Exception:
            log.exception("answering a read timeout failed; refusing (fail closed)")
            return to_response(answer(GATEWAY_ERROR, close=True))

    def _body_timed_out(self, flow: http.HTTPFlow) -> None:
        """A response body that paused for network.timeouts.read after its head went to
        the client (patches.install_upstream_timeouts cuts it off): audited as the HTTP/1
        engine audits it (the status sent, `upstream_timeout`); called by mitmproxy's
        layers, outside any hook: fails closed here (the cut goes on)."""
        ex: Exchange | None = flow.metadata.get(EXCHANGE)
        try:
            if ex is not None and not ex.done and flow.response is not None:
                log.info("response from %s:%d cut off: no response body bytes within %gs",
                         ex.target.host, ex.target.port, self.read_timeout)
                ex.finish(flow.response.status_code, error="upstream_timeout")
        except Exception:
            log.exception("auditing a response cut off by the read timeout failed")

    def _on_responseheaders(self, flow: http.HTTPFlow) -> None:
        ex: Exchange | None = flow.metadata.get(EXCHANGE)
        response = flow.response
        if ex is None or response is None or flow.metadata.get(ANSWERED):
            return
        head = ResponseHead(response.status_code, response.reason,
                            Headers(response.headers.fields), response.http_version)
        had_length = "content-length" in response.headers
        try:
            head = ex.response(head)
        except Refusal as refusal:
            # answered at once, the upstream's request cut (patches.install_head_refusal)
            flow.metadata[ANSWERED] = True
            flow.metadata[patches.HEAD_REFUSED] = to_response(ex.abort(refusal))
            return
        response.headers.fields = tuple(head.headers.fields)
        response.reason = head.reason
        if had_length and "content-length" not in response.headers and \
                not no_body(flow.request.method, response.status_code) and \
                not (response.is_http2 or response.is_http3):
            response.headers["transfer-encoding"] = "chunked"
        response.stream = _ResponseStream(ex, flow, self.proxyserver)

    def _on_response(self, flow: http.HTTPFlow) -> None:
        ex: Exchange | None = flow.metadata.get(EXCHANGE)
        response = flow.response
        if ex is not None and flow.websocket is None and response is not None:
            ex.finish(response.status_code)

    def _on_error(self, flow: http.HTTPFlow) -> None:
        ex: Exchange | None = flow.metadata.get(EXCHANGE)
        if ex is None or ex.done:
            return
        message = flow.error.msg if flow.error is not None else "error"
        timed_out = _timed_out(message)
        if timed_out is not None and flow.response is None:
            ex.upstream_failed(timed_out[0], timed_out[2])
            return
        error = patches.flow_error(message, responded=flow.response is not None,
                                   request_ended=flow.request.timestamp_end is not None,
                                   proxy_mark=PROXY_MARK,
                                   side=flow.metadata.get(patches.FAILED_SIDE))
        if error.kind == "client":  # (the sandbox left: the status it was answered, if)
            ex.finish(flow.response.status_code if flow.response is not None else None,
                      error="connection_closed")
        elif error.kind == "trailers":
            ex.abort(Refusal("unsupported", "HTTP/1 trailers are not relayed by the mitmproxy "
                             "engine (network.intercept: mitmproxy); the default engine "
                             "relays them"))
        elif error.kind == "bad_request":
            # The client's body is malformed (a bad chunk size...): mitmproxy closes the
            # connection at once, without an answer (it cannot send one on HTTP/1 then).
            ex.abort(Refusal("bad_request", "the request body is not valid HTTP/1 "
                             "(malformed chunked framing); the connection was closed"))
        elif error.kind == "upstream_proxy":
            ex.upstream_proxy_failed(error.detail)
        elif error.kind in ("closed", "connect"):
            ex.upstream_failed(error.kind, error.detail)
        else:
            assert flow.response is not None
            ex.finish(flow.response.status_code, error="upstream_failed")

    def _on_websocket_message(self, flow: http.HTTPFlow) -> None:
        assert flow.websocket is not None
        ex: Exchange | None = flow.metadata.get(EXCHANGE)
        message = flow.websocket.messages[-1]
        if message.injected:  # our own answer to a refused message (below)
            flow.websocket.messages.clear()
            return
        if ex is None or flow.metadata.get(ANSWERED):
            message.drop()  # refused before: mitmproxy may still deliver queued frames
            flow.websocket.messages.clear()
            return
        try:
            message.content = ex.ws_message(message.from_client, message.content)
        except MessageRefused as refused:  # dropped; the sandbox reads why, goes on
            message.drop()
            if self.proxyserver is not None and refused.reply:
                self.proxyserver.inject_websocket(flow, True, refused.reply)
        except Refusal as refusal:
            message.drop()
            # (later frames are dropped, see above; killing the flow alone does not end a
            # WebSocket in mitmproxy: the connections are closed, as the fast engine does)
            _abort(self.proxyserver, flow, ex.abort(refusal), write=False)
        finally:
            flow.websocket.messages.clear()  # relayed, never kept

    def _on_websocket_end(self, flow: http.HTTPFlow) -> None:
        ex: Exchange | None = flow.metadata.get(EXCHANGE)
        if ex is not None:
            ex.finish(101)

    def _on_server_connect_error(self, data: server_hooks.ServerConnectionHookData) -> None:
        _dial_failed(self, data)

    def _on_server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        address = data.server.address
        client = self.clients.get(data.client.id)
        if address is None or client is None:
            data.server.error = REFUSED_MARK + "no admitted destination"
            return
        try:
            host = normalize_host(str(address[0]))
        except DestinationError:
            data.server.error = REFUSED_MARK + "not a valid destination"
            return
        pinned = client.pins.get((host, int(address[1])))
        if pinned is None:
            data.server.error = (f"{REFUSED_MARK}{host}:{address[1]} was not admitted for "
                                 "this connection")
            return
        pin(pinned)
        proxy = self.proxy
        # mitmproxy dials with asyncio.open_connection: the loop routes that one dial
        # (this task's, to this pin) through the proxy (net/resolver.py), or direct
        # within network.timeouts.connect.
        if proxy is not None and proxy.applies(pinned.host, pinned.ip, pinned.port):
            route_pinned_dial(dialer(proxy, pinned, self.connect_timeout))
        else:
            route_pinned_dial(_timed_dial(pinned, self.connect_timeout,
                                          f"{host}:{address[1]}"))


def _dial_failed(adapter: Adapter, data: server_hooks.ServerConnectionHookData) -> None:
    """A passthrough tunnel whose dial failed: its audit line says so, as the default
    engine's does (`upstream_proxy_failed` through the upstream proxy, else
    `upstream_failed`: refused, unreachable, or no TCP connection within `connect`); an
    intercepted one's exchange does already. (Not a destination the gateway refused.)"""
    client = adapter.clients.get(data.client.id)
    error = data.server.error or ""
    if client is None or client.tunnel is None or not client.tunnel.passthrough \
            or error.startswith((REFUSED_MARK, BACKSTOP_MARK)):  # (the gateway's refusal)
        return
    adapter.tunnel_errors[data.client.id] = (
        "upstream_proxy_failed" if error.startswith(PROXY_MARK) else "upstream_failed")


def _abort(proxyserver: Any, flow: http.HTTPFlow, ans: Answer, *, write: bool = True) -> None:
    """Cut an exchange off mid-way: the client gets the refusal if it can still read an
    HTTP/1 answer on a cleartext connection (inside TLS, mitmproxy's layers hold the
    stream: bytes written to the socket would not be TLS records), then mitmproxy's
    connections of this client are closed."""
    flow.metadata[ANSWERED] = True
    h1 = not (flow.request.is_http2 or flow.request.is_http3) \
        and not flow.client_conn.tls_established
    if proxyserver is not None:
        patches.close_mitmproxy_connection(proxyserver, flow.client_conn.id,
                                           to_http1(ans) if write and h1 else None)
    if flow.killable:
        flow.kill()


def _forwardable_trailers(flow: http.HTTPFlow) -> None:
    """Request trailers (checked) go on only to an HTTP/2 upstream: mitmproxy's HTTP/1
    client cannot send them (it fails on them and drops the connection)."""
    if flow.request.trailers and flow.server_conn.alpn != b"h2":
        log.info("request trailers to %s dropped: the upstream speaks HTTP/1",
                 flow.request.host)
        flow.request.trailers = None


class _RequestStream:
    """mitmproxy's request stream filter: every body chunk through the exchange; at
    the end the held-back tail and the trailers."""

    __slots__ = ("ex", "flow", "proxyserver", "started")

    def __init__(self, ex: Exchange, flow: http.HTTPFlow, proxyserver: Any) -> None:
        self.ex = ex
        self.flow: http.HTTPFlow = weakref.proxy(flow)  # (the flow holds this: no cycle)
        self.proxyserver = proxyserver
        self.started = False  # a chunk (or the end) went through

    def __call__(self, chunk: bytes) -> bytes | list[bytes]:
        if self.flow.metadata.get(ANSWERED):
            self.flow.request.trailers = None  # (see below)
            return b""
        self.started = True
        try:
            if chunk:  # (nothing to send yet: no chunk at all; mitmproxy would write an
                # empty one, which ends a chunked body upstream: "0\r\n\r\n")
                out = self.ex.request_data(chunk)
                return [out] if out else []
            trailers = self.flow.request.trailers
            tail = self.ex.request_end(list(trailers.fields) if trailers else None)
            _forwardable_trailers(self.flow)
            return tail
        except Exception as exc:  # called by mitmproxy outside any hook: fail closed here
            refusal = exc if isinstance(exc, Refusal) else GATEWAY_ERROR
            if refusal is GATEWAY_ERROR:
                log.exception("checking a request body failed; refusing (fail closed)")
            # mitmproxy sends the request's trailers after this call unless the flow is
            # gone by then: refused trailers never go, and to an HTTP/1 upstream they
            # crashed its client (the sandbox then read a 502, not a closed stream)
            self.flow.request.trailers = None
            ans = self.ex.abort(refusal)
            if self.flow.request.is_http2 or self.flow.request.is_http3:
                # One stream of a multiplexed connection: that stream alone ends (the
                # refusal as its answer, or a reset if an answer began); the others go
                # on (patches.install_stream_refusal).
                self.flow.metadata[ANSWERED] = True
                self.flow.metadata[patches.STREAM_REFUSED] = to_response(ans)
                return []
            _abort(self.proxyserver, self.flow, ans)
            return b""


class _ResponseStream:
    """mitmproxy's response stream filter: redaction and counting by the exchange."""

    __slots__ = ("ex", "flow", "proxyserver")

    def __init__(self, ex: Exchange, flow: http.HTTPFlow, proxyserver: Any) -> None:
        self.ex = ex
        self.flow: http.HTTPFlow = weakref.proxy(flow)  # (the flow holds this: no cycle)
        self.proxyserver = proxyserver

    def __call__(self, chunk: bytes) -> list[bytes]:
        try:
            out = self.ex.response_data(chunk) if chunk else self.ex.response_end()
        except Exception as exc:  # called by mitmproxy outside any hook: fail closed here
            refusal = exc if isinstance(exc, Refusal) else GATEWAY_ERROR
            if refusal is GATEWAY_ERROR:
                log.exception("filtering a response failed; cutting it off (fail closed)")
            _abort(self.proxyserver, self.flow, self.ex.abort(refusal), write=False)
            return []
        # Never an empty chunk: mitmproxy would send it as the end of a chunked body.
        return [out] if out else []


HOOKS = ("client_connected", "client_disconnected", "http_connect", "next_layer",
         "requestheaders", "request", "responseheaders", "response", "error",
         "websocket_message", "websocket_end", "server_connect", "server_connect_error")
for _name in HOOKS:
    setattr(Adapter, _name, _guarded(getattr(Adapter, f"_on_{_name}")))
