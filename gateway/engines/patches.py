"""Every private API of a dependency the gateway uses, in one place, version-checked.

The engines need a few things their libraries keep private:

- **h11** (framing for the HTTP/1 engine): its strict head parsers and body readers
  (`h11._readers`: request and response heads validated against RFC 9110/9112 ABNF,
  chunked / Content-Length / close-delimited bodies with trailers) and its receive
  buffer (a Content-Length body is taken from its bytearray with one copy). The public
  `h11.Connection` wraps them in a state machine that costs four times as much per
  exchange; the engine keeps the state itself. On the admin
  listener (uvicorn's `h11.Connection`), the size of the chunk being read
  (`chunk_left`), so that a chunk size no body may have is refused once it is read.
- **mitmproxy** (the mitmproxy engine): its listener factory (to put the front door and
  the transparent door in front of its listeners, and to share ports among worker
  processes), its HTTP/1 and HTTP/2 error pages (replaced by the gateway's refusals,
  which never quote upstream bytes), the proxy server's connection handlers (to close
  a connection the leak scanner cut off mid-stream, and idle upstreams; and their log
  method, through which every layer logs — `Unexpected data from server: b'…'`, an
  HTTP/2 protocol error quoting a header — so that no quoted bytes reach the log), and
  its HTTP/1 client's conversion of an HTTP/2 request (one whose body has no
  Content-Length goes out chunked: mitmproxy sent it unframed, so an HTTP/1 upstream
  read a request without a body and the body's bytes as the next request:
  `install_h1_framing`), its HTTP stream's state for a streamed request body (a body
  refused part-way ends its own HTTP/2 stream, with the refusal, not the whole
  connection: `install_stream_refusal`; an upstream's answer refused at its head is
  answered at once, the upstream's request cut: `install_head_refusal`), its client TLS
  layer's sending (TLS 1.3
  session tickets held until the first answer, as the HTTP/1 engine holds them:
  `install_ticket_hold`), its connection handler's wakeup timers with its HTTP stream's
  and server TLS layer's states (`network.timeouts` on the upstream's TLS handshake,
  response head and each pause in a response body: `install_upstream_timeouts`), its
  layers (a layer that closes a refused tunnel, the TCP passthrough layer, the layer
  stack a tunnel or a redirected connection starts with, and the one reading of a failed
  flow's error text into a typed outcome: `flow_error`, with the side its HTTP stream's
  typed event came from: `install_error_sides`), the WebSocket fragmentizer, its
  reading of a ClientHello (restated here, held to mitmproxy's by a differential test:
  the doors read a tunnel's first bytes with it), its original-destination lookup
  (transparent mode), the raw method and authority of a request as sent, its cache of
  client-facing TLS contexts (cleared to replace their session ticket keys:
  `replace_client_tls_contexts`), and its next-layer addon (the adapter extends it).
  Its `mitmproxy.addons` package is registered without running its `__init__`,
  which imports every addon mitmdump ships (QUIC, pyparsing, ldap3, …: 15 MB a process)
  when the gateway uses four, and its `mitmproxy.proxy.layers` package likewise until
  the engine is loaded (`lean_packages`, `load_engine`): the doors read ClientHellos
  with the TLS layer alone, and mitmproxy's engine (~20 MB more) is imported when it
  is first started (`runtime/mitmproxy_engine.py`). This module is imported first by
  `gateway.engines` for that.
- **aiohttp** (the gateway's own HTTP client, `services/minting/http.py`): with
  `network.upstream_proxy` its connections go through the proxy to the address aiohttp
  resolved; aiohttp has no public hook between resolving a name and connecting, so
  `proxied_connector` overrides `TCPConnector._wrap_create_connection` (aiohttp itself
  is imported at the first such session only).

A version outside the ranges these were checked against stops the gateway at start
(`check_versions`), rather than failing open at run time.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import logging
import re
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import h11
from h11 import _abnf
from h11._readers import ChunkedReader as _H11ChunkedReader
from h11._readers import ContentLengthReader as _H11ContentLengthReader
from h11._readers import (
    Http10Reader,
    maybe_read_from_IDLE_client,
    maybe_read_from_SEND_RESPONSE_server,
)
from h11._receivebuffer import ReceiveBuffer, blank_line_regex
from mitmproxy import platform
from mitmproxy.net import tls as _mitmproxy_tls
from mitmproxy.net.tls import starts_like_tls_record

if TYPE_CHECKING:
    from mitmproxy import http
    from mitmproxy.addons.next_layer import NextLayer as NextLayerAddon
    from mitmproxy.proxy.layers.websocket import Fragmentizer

__all__ = [
    "FAILED_SIDE",
    "HANDSHAKE_OPTION",
    "HEAD_REFUSED",
    "READ_TIMEOUT",
    "STREAM_REFUSED",
    "ChunkedReader",
    "ContentLengthReader",
    "Fragmentizer",
    "Http10Reader",
    "NextLayerAddon",
    "RawRequest",
    "RawResponse",
    "ReadTimeout",
    "ReceiveBuffer",
    "add_handshake_option",
    "check_versions",
    "chunk_left",
    "client_hello",
    "close_mitmproxy_connection",
    "install_error_pages",
    "install_error_sides",
    "install_h1_framing",
    "install_head_refusal",
    "install_listeners",
    "install_log_hygiene",
    "install_stream_refusal",
    "install_ticket_hold",
    "install_upstream_timeouts",
    "lean_dependencies",
    "lean_package",
    "load_engine",
    "original_destination",
    "parse_request_head",
    "proxied_connector",
    "raw_authority",
    "raw_method",
    "read_request_head",
    "read_response_head",
    "replace_client_tls_contexts",
    "starts_like_tls",
]

CHECKED = {"aiohttp": ("3.14.",), "h11": ("0.16.",), "mitmproxy": ("12.2.",)}


_BARE = ("mitmproxy.addons", "mitmproxy.proxy.layers")


def lean_packages() -> None:
    """Register mitmproxy's `addons` and `proxy.layers` packages bare (their `__path__`,
    not their `__init__`): `from mitmproxy.addons import core` then loads `core` alone,
    and the doors read a ClientHello with `layers.tls` without loading every layer
    (HTTP/1, HTTP/2, QUIC with aioquic, DNS, ...). `addons/__init__` only holds
    mitmdump's `default_addons()`, which the gateway never calls; `layers/__init__`
    runs when the mitmproxy engine is loaded (`load_engine`). Must run before anything
    imports from either package."""
    for name in _BARE:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or spec.submodule_search_locations is None:
            continue
        package = importlib.util.module_from_spec(spec)
        sys.modules[name] = package
        parent, _, child = name.rpartition(".")
        vars(sys.modules[parent])[child] = package  # (as an import would)


lean_packages()


def lean_package(package: str, names: dict[str, str]) -> None:
    """Register `package` bare (its `__path__`, not its `__init__`), as `lean_packages`
    does mitmproxy's: `names` maps each name the gateway takes from the package to the
    submodule defining it, imported now (a gateway process uses them all: its first
    request imports nothing); a submodule imports as usual; any other name runs the
    package's `__init__` at its first read (the whole package from then on). For
    packages whose `__init__` imports, for names the gateway never uses, modules it
    never needs (issue 41, a worker's idle memory). A no-op once the package is
    imported; must run before anything imports it."""
    if package in sys.modules:
        return
    spec = importlib.util.find_spec(package)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return
    module = importlib.util.module_from_spec(spec)
    loader = spec.loader
    namespace = vars(module)

    def attribute(name: str) -> Any:
        where = names.get(name)
        if where is not None:
            __import__(f"{package}.{where}")  # (not importlib's: -X importtime sees it)
            namespace[name] = value = getattr(sys.modules[f"{package}.{where}"], name)
            return value
        if name.startswith("__") and name != "__version__":
            raise AttributeError(name)  # (copy, pickle and inspect probe dunders)
        if importlib.util.find_spec(f"{package}.{name}") is not None:
            raise AttributeError(name)  # (`from package import submodule`: imported)
        namespace.pop("__getattr__", None)  # the whole package from now on
        loader.exec_module(module)
        return getattr(module, name)

    namespace["__getattr__"] = attribute
    sys.modules[package] = module
    for name in names:
        attribute(name)


# The packages `lean_dependencies` registers bare, with the names the gateway takes
# from each (a test holds each name to the one the whole package exports):
LEAN = {
    # uvicorn's `__init__` imports `uvicorn.main`, its command line (click, and
    # multiprocessing for `--reload` and `--workers`: 27 modules, ~1.5 MB of a worker's
    # memory), for the `run` and `main` it exports; the admin listener is served by
    # `Config` and `Server` (which uvicorn's own lifespan modules import from the package).
    "uvicorn": {"Config": "config", "Server": "server"},
    # prometheus_client's imports its exposition (http.server, wsgiref, socketserver,
    # gzip, urllib.request: the HTTP servers and push clients it offers), which the
    # gateway uses only to answer /metrics (`observability/metrics.exposition`).
    "prometheus_client": {"CollectorRegistry": "registry", "Counter": "metrics",
                          "Gauge": "metrics", "Histogram": "metrics"},
    # PyJWT's imports its JWKS client (urllib.request, http.client, email), which the
    # gateway never uses: the pods' issuer keys are fetched by its own client.
    "jwt": {"encode": "api_jwt", "decode": "api_jwt", "PyJWK": "api_jwk",
            "get_unverified_header": "api_jws", "PyJWTError": "exceptions",
            "ExpiredSignatureError": "exceptions", "InvalidAudienceError": "exceptions",
            "InvalidIssuerError": "exceptions", "InvalidKeyError": "exceptions",
            "InvalidSignatureError": "exceptions", "InvalidTokenError": "exceptions",
            "DecodeError": "exceptions"},
}


def lean_dependencies() -> None:
    """`lean_package` for each of `LEAN`: a gateway process (`run`) calls it before it
    imports the gateway's modules (`gateway/__main__.py`)."""
    for package, names in LEAN.items():
        lean_package(package, names)


from mitmproxy.net.check import is_valid_host  # noqa: E402


@functools.cache
def load_engine() -> None:
    """Complete `mitmproxy.proxy.layers` (its `__init__` run on the bare package: the
    proxy server and the next-layer addon name the layers through it). Runs before any
    other part of mitmproxy's engine is imported: in the installers below and at the
    first use of `NextLayerAddon`."""
    package = sys.modules["mitmproxy.proxy.layers"]
    spec = package.__spec__
    if spec is not None and spec.loader is not None and not hasattr(package, "HttpLayer"):
        spec.loader.exec_module(package)


def __getattr__(name: str) -> Any:
    """`NextLayerAddon` (the addon the mitmproxy adapter extends: its choice of TLS and
    HTTP layers stays mitmproxy's) and `Fragmentizer` (the HTTP/1 engine's WebSocket
    relay frames messages with it), imported at their first use."""
    if name == "NextLayerAddon":
        load_engine()
        from mitmproxy.addons.next_layer import NextLayer
        globals()[name] = NextLayer
        return NextLayer
    if name == "Fragmentizer":  # (the WebSocket layer alone: 0.4 MiB, not the engine's 6)
        from mitmproxy.proxy.layers.websocket import Fragmentizer as fragmentizer
        globals()[name] = fragmentizer
        return fragmentizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- mitmproxy's layers: what the adapter (engines/mitm.py) places in a connection --------
# `mitmproxy.proxy.layer.Layer`, its commands and events, and the layer classes are the
# proxy core's, not the addon API's: subclassed and matched here, checked with CHECKED.


@functools.cache
def _layers() -> Any:
    """The layer classes, once the engine is loaded (`load_engine`)."""
    load_engine()
    from mitmproxy.proxy import commands, events, layer
    from mitmproxy.proxy.layers import modes
    from mitmproxy.proxy.layers.http import HttpLayer, HttpStream
    from mitmproxy.proxy.layers.tcp import TCPLayer

    class RefuseLayer(layer.Layer):
        """Closes the client connection at once (bytes a tunnel may not carry)."""

        def __init__(self, context: Any, reason: str) -> None:
            super().__init__(context)
            self.reason = reason
            self.closed = False

        def _handle_event(self, event: events.Event) -> Any:
            if not self.closed:
                self.closed = True
                yield commands.Log(f"refused tunnel bytes: {self.reason}", logging.INFO)
                yield commands.CloseConnection(self.context.client)

    class Layers(NamedTuple):
        refuse: Any
        tcp: Any
        next_layer: Any
        http_proxy: Any
        transparent: Any
        http: Any
        stream: Any

    return Layers(RefuseLayer, TCPLayer, layer.NextLayer, modes.HttpProxy,
                  modes.TransparentProxy, HttpLayer, HttpStream)


def refuse_layer(context: Any, reason: str) -> Any:
    """A layer that closes the client's connection at once (`reason` logged)."""
    return _layers().refuse(context, reason)


def passthrough_layer(context: Any) -> Any:
    """mitmproxy's TCP layer relaying bytes unread (a passthrough tunnel)."""
    return _layers().tcp(context, ignore=True)


def is_next_layer(target: object) -> bool:
    """True for mitmproxy's next-layer hook data (whose `layer` the adapter sets)."""
    return isinstance(target, _layers().next_layer)


def tunnel_start(context: Any) -> bool:
    """The first layer inside a CONNECT tunnel of the regular proxy."""
    found = _layers()
    stack = context.layers
    return (len(stack) == 3 and isinstance(stack[0], found.http_proxy)
            and isinstance(stack[1], found.http) and isinstance(stack[2], found.stream))


def transparent_start(context: Any) -> bool:
    """The first layer of a transparently redirected connection."""
    stack = context.layers
    return len(stack) == 1 and isinstance(stack[0], _layers().transparent)


class FlowError(NamedTuple):
    """What ended a flow, read from mitmproxy's error (`kind`: `trailers` our reader's
    refusal of HTTP/1 trailers, `bad_request` a malformed body from the client, `client`
    the client left (its connection closed, its stream reset), `upstream_proxy` the
    upstream proxy's dial (`detail`: its fixed sentences), `closed` / `connect` the
    upstream before an answer; `answered`: the upstream after the answer began)."""

    kind: str
    detail: str = ""


# mitmproxy 12.2's words for an HTTP/1 framing error of the client's request body.
_H1_PROTOCOL_ERROR = "HTTP/1 protocol error"


def flow_error(message: str, *, responded: bool, request_ended: bool,
               proxy_mark: str, side: str | None = None) -> FlowError:
    """The one reading of a failed flow's error (mitmproxy keeps its text only; `side`:
    which connection's error it was, `failed_side`): the typed outcome the adapter
    answers by."""
    if TRAILERS_UNSUPPORTED in message:  # our own reader's words (below)
        return FlowError("trailers")
    if side == "client" and (request_ended or not message.startswith(_H1_PROTOCOL_ERROR)):
        return FlowError("client")
    if responded:
        return FlowError("answered")
    if not request_ended and message.startswith(_H1_PROTOCOL_ERROR):
        return FlowError("bad_request")
    if message.startswith(proxy_mark):
        return FlowError("upstream_proxy", message[len(proxy_mark):][:300])
    return FlowError("closed" if "closed" in message else "connect", message)


FAILED_SIDE = "sandbox-gateway-failed-side"  # flow.metadata: `client` or `server`
_error_side: dict[str, Any] = {}


def install_error_sides() -> None:
    """mitmproxy keeps a failed flow's error as text only, and a sandbox that leaves
    (`Client disconnected.`, `stream reset by client (CANCEL)`) reads like an upstream
    that failed. Its HTTP stream gets the typed event (a `RequestProtocolError` comes
    from the client's connection, a `ResponseProtocolError` from the upstream's): the
    side is put in `flow.metadata[FAILED_SIDE]` before the `error` hook runs
    (`HttpStream.handle_protocol_error`, and `check_killed` for a client gone while a
    hook ran)."""
    load_engine()
    from mitmproxy.proxy.layers import http as layers_http
    from mitmproxy.proxy.layers.http._events import RequestProtocolError

    stream = layers_http.HttpStream
    _error_side["client"] = RequestProtocolError  # (the client's side of a stream)
    _error_side.setdefault("handle", stream.handle_protocol_error)
    _error_side.setdefault("killed", stream.check_killed)
    stream.handle_protocol_error = _handle_protocol_error  # type: ignore[method-assign]
    stream.check_killed = _check_killed  # type: ignore[method-assign]


def _handle_protocol_error(self: Any, event: Any) -> Any:
    side = "client" if isinstance(event, _error_side["client"]) else "server"
    self.flow.metadata.setdefault(FAILED_SIDE, side)
    return (yield from _error_side["handle"](self, event))


def _check_killed(self: Any, emit_error_hook: bool) -> Any:
    if self._paused_event_queue and any(isinstance(e, _error_side["client"])
                                        for e in self._paused_event_queue):
        self.flow.metadata.setdefault(FAILED_SIDE, "client")
    return (yield from _error_side["killed"](self, emit_error_hook))


@functools.cache
def _installed(package: str) -> str:
    """The installed version of `package`: h11's and mitmproxy's from the packages
    themselves (imported already), any other from its distribution's metadata
    (`importlib.metadata`: 18 modules, 1 MB a process would hold for this one read)."""
    if package == "h11":
        from h11._version import __version__

        return str(__version__)
    if package == "mitmproxy":
        from mitmproxy.version import VERSION

        return str(VERSION)
    from importlib.metadata import version

    return version(package)


def check_versions(*, aiohttp: bool = True) -> None:
    """Refuse to run with a dependency version these patches were not checked with.
    `aiohttp`: whether aiohttp's hook will be used (`proxied_connector`: only with
    `network.upstream_proxy`); without it its version does not matter here."""
    for package, prefixes in CHECKED.items():
        if package == "aiohttp" and not aiohttp:
            continue
        found = _installed(package)
        if not found.startswith(prefixes):
            raise RuntimeError(
                f"{package} {found} is installed, but gateway/engines/patches.py was checked "
                f"against {', '.join(p + 'x' for p in prefixes)}; install a supported version "
                "(pyproject.toml pins it) or re-check the patches")


MAX_CHUNK = (1 << 63) - 1  # the largest chunk size taken (what fits in a signed 64-bit size)


class ChunkedReader(_H11ChunkedReader):
    """h11's chunked body reader, refusing a chunk size no implementation can hold: h11
    takes up to 20 hex digits (`ffffffffffffffffffff` is 2**80 - 1) and then waits for
    that many bytes, holding the connection until the idle timeout. Past 63 bits it is a
    protocol error at once (nginx and curl draw the line there too): the HTTP/1 engine
    and mitmproxy answer it 400 (a response from an upstream: 502)."""

    def __call__(self, buf: ReceiveBuffer) -> Any:
        event = super().__call__(buf)
        if self._bytes_in_chunk > MAX_CHUNK:
            raise h11.LocalProtocolError("chunk size too large (more than 63 bits)")
        return event


class ContentLengthReader(_H11ContentLengthReader):
    """h11's Content-Length body reader, taking what the buffer holds with one copy:
    h11's `maybe_extract_at_most` slices the buffer twice (once to see whether it is
    empty) and hands out a bytearray, which the engine copied once more into bytes. A
    100 MB download went through three copies of itself there; now one."""

    def __call__(self, buf: ReceiveBuffer) -> Any:
        if self._remaining == 0:
            return h11.EndOfMessage()
        data: bytearray = buf._data
        if not data:
            return None
        count = min(self._remaining, len(data))
        if count == len(data):
            out = bytes(data)
            data.clear()
        else:
            with memoryview(data) as view, view[:count] as head:
                out = bytes(head)
            del data[:count]
        buf._next_line_search = 0  # (what h11's `_extract` resets)
        buf._multiple_lines_search = 0
        self._remaining -= count
        return h11.Data(data=out)

    @property
    def remaining(self) -> int:
        """Bytes of the body still to be read."""
        return int(self._remaining)

    def took(self, count: int) -> None:
        """`count` bytes of the body were read without this reader (`Side.chunks`)."""
        if count > self._remaining:
            raise h11.RemoteProtocolError("more body bytes than the Content-Length")
        self._remaining -= count


def chunk_left(conn: h11.Connection) -> int:
    """The bytes still to come of the chunk an `h11.Connection` is reading (0 when it is
    reading no chunked body): uvicorn's connection on the admin listener, whose bounds
    (`api/bounds.py`) refuse a chunk size past 63 bits or past `admin.max_body` as soon
    as the size is read, where h11 would wait for that many bytes."""
    reader = getattr(conn, "_reader", None)
    return int(reader._bytes_in_chunk) if isinstance(reader, _H11ChunkedReader) else 0


class RawRequest(NamedTuple):
    """A request head as h11's grammar reads it: fields as sent (name case kept), with
    h11's normalisation of Content-Length and Transfer-Encoding applied."""

    method: bytes
    target: bytes
    http_version: bytes
    fields: list[tuple[bytes, bytes]]


class RawResponse(NamedTuple):
    """A response head as h11's grammar reads it (see `RawRequest`)."""

    status_code: int
    reason: bytes
    http_version: bytes
    fields: list[tuple[bytes, bytes]]


# h11's grammar (`h11._abnf`), compiled once for a whole head: the start line, every
# field line and the blank line in one match. A head this reads is one h11 reads the
# same; anything else (obsolete line folding, bare LF line ends, a malformed line, a
# field h11 would rewrite) goes through h11's own reader, which reads or refuses it.
# A field line is h11's `field_name ":" OWS [field_content] OWS`: its value part may hold
# any byte but NUL, CR, LF, VT and FF (`field_vchar` is `[^\x00\s]`, and SP and HTAB
# are allowed between them and around them), so the same set of lines is matched by a
# character class, without the nested repetition; the value is what is left once the
# OWS on both sides is stripped (`test_head_reader.py` compares both with h11's reader).
# The class is written as the two ranges it is (every byte but 00 and 0A-0D): re's
# negated form matched a head carrying a token in 2.4x the time (3.6 against 1.5 µs).
_FIELD = f"{_abnf.field_name}:[\\x01-\\x09\\x0e-\\xff]*\r\n"
_REQUEST_HEAD = re.compile(
    f"{_abnf.request_line}\r\n(?P<fields>(?:{_FIELD})*)\r\n".encode("ascii"))
# A status h11's grammar reads (three digits) but its events refuse (below 100) is left
# to h11's reader, which refuses it.
_STATUS_LINE = _abnf.status_line.replace(_abnf.status_code, "[1-9][0-9]{2}")
if _abnf.status_line == _STATUS_LINE:  # (h11's grammar changed: check_versions' job too)
    raise RuntimeError("h11's status line grammar is not the one patches.py was checked on")
_RESPONSE_HEAD = re.compile(
    f"{_STATUS_LINE}\r\n(?P<fields>(?:{_FIELD})*)\r\n".encode("ascii"))
_CONTENT_LENGTH = re.compile(rb"\ncontent-length:[ \t]*([0-9]{1,20})[ \t]*\r")


def _fields(data: bytearray, match: re.Match[bytes], request: bool
            ) -> list[tuple[bytes, bytes]] | None:
    """The field lines of a head `match` read, if h11's normalisation leaves them as
    they are: at most one Content-Length, of digits only; no Transfer-Encoding; for a
    request, at most one Host (the caller checks HTTP/1.1 has one). None: let h11 read
    the head."""
    start, end = match.span("fields")
    lower = b"\n" + data[start:end].lower()
    if lower.find(b"\ntransfer-encoding:") >= 0:  # (`find`, not `in`: core/leaks.py `_plain`)
        return None
    lengths = lower.count(b"\ncontent-length:")
    if lengths > 1 or (lengths == 1 and _CONTENT_LENGTH.search(lower) is None):
        return None
    if request:
        hosts = lower.count(b"\nhost:")
        if hosts > 1 or (hosts == 0 and match.group("http_version") == b"1.1"):
            return None
    fields = []
    for line in bytes(data[start:end - 2]).split(b"\r\n") if end > start else ():
        name, _, value = line.partition(b":")  # (a token holds no colon)
        fields.append((name, value.strip(b" \t")))
    return fields


def _one_pass(buf: ReceiveBuffer, head: re.Pattern[bytes], request: bool, *names: str
              ) -> tuple[list[Any], list[tuple[bytes, bytes]]] | None:
    """The start line's `names` and the fields of the head at the start of `buf`,
    taken out of `buf`, if the one pass reads it; None: h11's reader is to read it (or
    say it is incomplete). (A match's groups are read from the buffer when asked for:
    before it is cut.)"""
    data = buf._data
    blank = blank_line_regex.search(data, buf._multiple_lines_search)
    if blank is None:
        return None
    match = head.fullmatch(data, 0, blank.end())
    if match is None:
        return None
    fields = _fields(data, match, request)
    if fields is None:
        return None
    line = list(match.group(*names))
    buf._extract(blank.end())
    return line, fields


def read_request_head(buf: ReceiveBuffer) -> RawRequest | None:
    """The next request head in `buf` (h11's strict grammar), None if incomplete.
    Raises h11.LocalProtocolError for a malformed head."""
    if not buf:
        return None  # (what h11 says of an empty buffer)
    read = _one_pass(buf, _REQUEST_HEAD, True, "method", "target", "http_version")
    if read is not None:
        (method, target, version), fields = read
        return RawRequest(method, target, version, fields)
    event = maybe_read_from_IDLE_client(buf)
    if event is None:
        return None
    assert isinstance(event, h11.Request)
    return RawRequest(event.method, event.target, event.http_version,
                      event.headers.raw_items())


def read_response_head(buf: ReceiveBuffer) -> RawResponse | None:
    """The next response head in `buf` (an informational one too), None if incomplete.
    Raises h11.LocalProtocolError for a malformed head."""
    if not buf:
        return None
    read = _one_pass(buf, _RESPONSE_HEAD, False, "status_code", "reason", "http_version")
    if read is not None:
        (status, reason, version), fields = read
        return RawResponse(int(status), reason or b"", version, fields)
    event = maybe_read_from_SEND_RESPONSE_server(buf)
    if event is None:
        return None
    assert isinstance(event, (h11.Response, h11.InformationalResponse))
    return RawResponse(event.status_code, event.reason, event.http_version,
                       event.headers.raw_items())


def parse_request_head(data: bytes) -> RawRequest:
    """A whole request head (`data` ends with its blank line) read by the same parser as
    every other head: the front door's CONNECT and the first bytes of a redirected
    connection. Raises ValueError, in h11's words, for a malformed or incomplete head.

    h11 refuses an HTTP/1.1 request without Host, as RFC 9110 asks; a CONNECT names its
    authority in the request line and clients send it without Host (and proxies take
    it), so such a CONNECT is read as if it carried `Host: <its request target>`."""
    try:
        return _parse_head(data)
    except ValueError as exc:
        if not (data.startswith(b"CONNECT ") and str(exc) == _NO_HOST):
            raise
    end = data.index(b"\r\n") + 2
    target = data[:end].split(b" ")[1]
    return _parse_head(data[:end] + b"Host: " + target + b"\r\n" + data[end:])


_NO_HOST = "Missing mandatory Host: header"  # (h11 0.16's words)


def _parse_head(data: bytes) -> RawRequest:
    buf = ReceiveBuffer()
    buf += data
    try:
        event = read_request_head(buf)
    except h11.LocalProtocolError as exc:
        raise ValueError(str(exc)) from None
    if event is None:
        raise ValueError("the request head is incomplete")
    return event


# -- mitmproxy ---------------------------------------------------------------------------


# The ClientHello is read as mitmproxy's parser (its kaitai-struct `TlsClientHello`) reads
# it, the way `mitmproxy.proxy.layers.tls.parse_client_hello` and `mitmproxy.tls.ClientHello`
# do: the handshake message gathered from its records, then the server name and
# the ALPN offers. Those two functions are restated here (from mitmproxy 12.2) because
# their modules import mitmproxy's proxy core (its options manager with ruamel.yaml,
# connection types, the Rust extension): 5 MiB a worker holds from start for nothing
# but this read. `test_first_bytes.py` holds these to mitmproxy's answers.


def _handshake_message(data: bytes) -> bytes | None:
    """The first handshake message carried by the TLS records `data` starts with (its
    4-byte header included); None while more bytes are needed. Raises ValueError at a
    record that is not a handshake record, or an empty one."""
    message = b""
    offset = 0
    while len(data) >= offset + 5:
        header = data[offset:offset + 5]
        if not starts_like_tls_record(header):
            raise ValueError(f"Expected TLS record, got {header!r} instead.")
        size = int.from_bytes(header[3:5], "big")
        if size == 0:
            raise ValueError("Record must not be empty.")
        offset += 5
        if len(data) < offset + size:
            return None
        message += data[offset:offset + size]
        offset += size
        if len(message) >= 4:
            total = int.from_bytes(message[1:4], "big") + 4
            if len(message) >= total:
                return message[:total]
    return None


def client_hello(data: bytes) -> tuple[str | None, tuple[bytes, ...]] | None:
    """The server name and ALPN offers of the TLS ClientHello `data` starts with; None
    while more bytes are needed. Raises ValueError when `data` does not start a TLS
    record or its ClientHello is broken."""
    if not starts_like_tls_record(data):
        raise ValueError("not a TLS record")
    message = _handshake_message(data)
    if not message:
        return None
    sni: str | None = None
    alpn: tuple[bytes, ...] | None = None
    for kind, body in _hello_extensions(message[4:]):
        if kind == 0x00:
            names = _server_names(body)
            if sni is None and len(names) == 1 and names[0][0] == 0 \
                    and _valid_host(names[0][1]):
                sni = names[0][1].decode("ascii")
        elif kind == 0x10:
            protocols = _alpn_protocols(body)
            if alpn is None:
                alpn = protocols
    return sni, alpn or ()


# The ClientHello's fields are read as mitmproxy's kaitai-struct parser reads them
# (`mitmproxy/contrib/kaitaistruct/tls_client_hello.py`, generated from its .ksy): the
# same bytes taken, the same truncations refused (its EOFError: ValueError here), with
# slices instead of ~300 calls into a stream object per hello (a fifth of the Python
# calls of a request on a new connection; issue 41). `test_first_bytes.py` compares
# both readings on real, recut, truncated and mutated ClientHellos.
_BROKEN = "Invalid ClientHello"
# mitmproxy's check of a server name (an IDNA decoding and a match per label: ~5 µs),
# remembered per name: sandboxes name the same few hosts again and again.
_valid_host = functools.lru_cache(maxsize=1024)(is_valid_host)


_READ = frozenset((0x00, 0x10))  # server_name, application_layer_protocol_negotiation


def _hello_extensions(body: bytes) -> list[tuple[int, bytes]]:
    """The (type, body) of each server_name and ALPN extension of a ClientHello's `body`
    (after the handshake header), every extension's framing checked: version, random,
    session id, cipher suites (kaitai reads `len // 2` of them), compression methods,
    then, unless the body ends there, the extensions' length (not used) and every
    extension up to the end."""
    size = len(body)
    if size < 35:  # version (2), random (32), the session id's length (1)
        raise ValueError(_BROKEN)
    at = 35 + body[34]  # (past the session id)
    if at + 2 > size:
        raise ValueError(_BROKEN)
    at += 2 + (body[at] << 8 | body[at + 1]) // 2 * 2  # (the cipher suites)
    if at + 1 > size:
        raise ValueError(_BROKEN)
    at += 1 + body[at]  # (the compression methods)
    if at > size:
        raise ValueError(_BROKEN)
    extensions: list[tuple[int, bytes]] = []
    if at == size:
        return extensions
    at += 2  # (the extensions' length)
    if at > size:
        raise ValueError(_BROKEN)
    while at < size:
        start = at + 4
        if start > size:
            raise ValueError(_BROKEN)
        kind = body[at] << 8 | body[at + 1]
        at = start + (body[at + 2] << 8 | body[at + 3])
        if at > size:
            raise ValueError(_BROKEN)
        if kind in _READ:
            extensions.append((kind, body[start:at]))
    return extensions


def _server_names(body: bytes) -> list[tuple[int, bytes]]:
    """The (name type, name) entries of a server_name extension's `body`: its list's
    length (not used), then entries up to the end."""
    size = len(body)
    if size < 2:
        raise ValueError(_BROKEN)
    at = 2
    names: list[tuple[int, bytes]] = []
    while at < size:
        start = at + 3
        if start > size:
            raise ValueError(_BROKEN)
        end = start + (body[at + 1] << 8 | body[at + 2])
        if end > size:
            raise ValueError(_BROKEN)
        names.append((body[at], body[start:end]))
        at = end
    return names


def _alpn_protocols(body: bytes) -> tuple[bytes, ...]:
    """The protocol names of an ALPN extension's `body`: its list's length (not used),
    then names up to the end."""
    size = len(body)
    if size < 2:
        raise ValueError(_BROKEN)
    at = 2
    protocols: list[bytes] = []
    while at < size:
        end = at + 1 + body[at]
        if end > size:
            raise ValueError(_BROKEN)
        protocols.append(body[at + 1:end])
        at = end
    return tuple(protocols)


def replace_client_tls_contexts() -> None:
    """mitmproxy's TLS contexts for clients made anew at their next use: it caches them
    by their options (`net.tls.create_client_proxy_context`), so every client connection
    shares one, and with it the key that seals its session tickets; new contexts draw new
    keys. Connections open keep theirs."""
    _mitmproxy_tls.create_client_proxy_context.cache_clear()


def starts_like_tls(data: bytes) -> bool:
    """`data` starts like a TLS handshake record."""
    return bool(starts_like_tls_record(data))


def original_destination(sock: Any) -> tuple[str, int]:
    """The address a redirected connection was bound for (SO_ORIGINAL_DST on Linux)."""
    if platform.original_addr is None:
        raise OSError("this platform cannot read a connection's original destination")
    raw = platform.original_addr(sock)
    return str(raw[0]), int(raw[1])


def raw_method(request: http.Request) -> str:
    """The method as sent (`Request.method` upper-cases it: "get" is not "GET")."""
    return request.data.method.decode("latin-1")


def raw_authority(request: http.Request) -> str:
    """The authority of an absolute-form request target as sent ("" for origin-form)."""
    return request.data.authority.decode("latin-1")



_listeners: dict[str, Any] = {"sockets": {}, "servers": {}, "listen": None}


async def _listen(self: Any, host: str, port: int) -> list[Any]:
    """mitmproxy's listen, on what the gateway bound (no close-and-rebind race, no port
    shared by accident): a listener the gateway already serves with its door in front
    (taken as mitmproxy's own, to report and to close), or a bound socket mitmproxy
    serves itself."""
    served = _listeners["servers"].pop((self.mode.type_name, port), None)
    if served is not None and self.mode.transport_protocol == "tcp":
        return [served]
    sock = _listeners["sockets"].pop((self.mode.type_name, port), None)
    if self.mode.transport_protocol != "tcp" or sock is None:
        return list(await _listeners["listen"](self, host, port))
    return [await asyncio.start_server(self.handle_stream, sock=sock)]


def install_listeners(*, sockets: dict[tuple[str, int], Any] | None = None,
                      servers: dict[tuple[str, int], Any] | None = None) -> None:
    """Route this process's mitmproxy listeners through `_listen` (one Master per
    process), by (mode, port): `sockets`, bound listening sockets mitmproxy serves
    (`network.intercept: mitmproxy`); `servers`, listeners the gateway's doors serve,
    which hand mitmproxy what they do not serve themselves (mitmproxy started on
    demand)."""
    load_engine()
    from mitmproxy.proxy import mode_servers

    if _listeners["listen"] is None:
        _listeners["listen"] = mode_servers.AsyncioServerInstance.listen
    _listeners.update(sockets=dict(sockets or {}), servers=dict(servers or {}))
    mode_servers.AsyncioServerInstance.listen = _listen  # type: ignore[method-assign]


_h2_answer: dict[str, Any] = {}


def _h2_handle_event(self: Any, event: Any) -> Any:
    """mitmproxy's HTTP/2 event handling, except its error page: an error answered on a
    stream that has not started its response gets the gateway's answer (headers and
    body) instead of mitmproxy's HTML."""
    from mitmproxy.proxy.commands import SendData
    from mitmproxy.proxy.layers.http._events import ResponseProtocolError

    make = _h2_answer.get("make")
    if make is not None and isinstance(event, ResponseProtocolError) \
            and not self.is_closed(event.stream_id) and self.is_open_for_us(event.stream_id):
        stream = self.h2_conn.streams[event.stream_id]
        status = event.code.http_status_code()
        if not stream.state_machine.headers_sent and status is not None:
            status, fields, body = make(status, event.message)
            self.h2_conn.send_headers(event.stream_id, [(b":status", b"%d" % status), *fields])
            self.h2_conn.send_data(event.stream_id, body, end_stream=True)
            yield SendData(self.conn, self.h2_conn.data_to_send())
            return
    yield from _h2_answer["original"](self, event)


TRAILERS_UNSUPPORTED = "HTTP/1 trailers are not supported by the mitmproxy engine"


class _NoTrailersReader(ChunkedReader):
    """mitmproxy's HTTP/1 layer cannot relay trailers (it raises NotImplementedError,
    which drops the connection with a traceback): end such a message as an HTTP
    protocol error instead, which mitmproxy answers (400 / 502) and logs in one line."""

    def __call__(self, buf: ReceiveBuffer) -> Any:
        event = super().__call__(buf)
        if isinstance(event, h11.EndOfMessage) and event.headers:
            raise h11.LocalProtocolError(TRAILERS_UNSUPPORTED)
        return event


_h1_send: dict[str, Any] = {}


def _h1_client_send(self: Any, event: Any) -> Any:
    """mitmproxy's HTTP/1 client, except that an HTTP/2 or HTTP/3 request whose body has
    no length (no Content-Length, the stream not ended with its headers) is sent with
    `Transfer-Encoding: chunked`. mitmproxy converted it to an HTTP/1.1 head with neither
    and then wrote the body bytes as they are: the upstream read a request without a
    body, and the body as the next request on the connection (a second request no policy
    decided), or closed the connection on it (the sandbox saw a 502 instead of a
    refusal). The header is set on the request the client frames the body by."""
    from mitmproxy.proxy.layers.http._events import RequestHeaders

    if isinstance(event, RequestHeaders) and not event.end_stream:
        request = event.request
        if (request.is_http2 or request.is_http3) and "content-length" not in request.headers \
                and "transfer-encoding" not in request.headers:
            request.headers["transfer-encoding"] = "chunked"
    yield from _h1_send["original"](self, event)


def install_h1_framing() -> None:
    """Frame the bodies of HTTP/2 requests of unknown length sent to HTTP/1 upstreams
    (`_h1_client_send`)."""
    load_engine()
    from mitmproxy.proxy.layers.http import _http1

    _h1_send.setdefault("original", _http1.Http1Client.send)
    _http1.Http1Client.send = _h1_client_send  # type: ignore[method-assign]


def install_error_pages(
        http1: Callable[[int, str], bytes],
        http2: Callable[[int, str], tuple[int, list[tuple[bytes, bytes]], bytes]]) -> None:
    """Replace mitmproxy's own error answers: `http1(status, message)` gives the whole
    HTTP/1 response, `http2(status, message)` the HTTP/2 one (status, fields, body)."""
    load_engine()
    from mitmproxy.proxy.layers.http import _http1, _http2

    _h2_answer.setdefault("original", _http2.Http2Connection._handle_event)
    _http1.make_error_response = http1  # type: ignore[assignment]
    _http1.ChunkedReader = _NoTrailersReader  # type: ignore[attr-defined]
    _h2_answer["make"] = http2
    _http2.Http2Connection._handle_event = _h2_handle_event  # type: ignore[method-assign]


_log_phrase: dict[str, Any] = {}


def _log(self: Any, message: str, level: int = logging.INFO, exc_info: Any = None) -> None:
    """mitmproxy's connection log, its message cut to the words before quoted bytes."""
    clean = _log_phrase.get("clean")
    _log_phrase["original"](self, clean(message) if clean is not None else message, level,
                            exc_info)


def install_log_hygiene(clean: Callable[[str], str]) -> None:
    """Every message mitmproxy's layers log (through `ConnectionHandler.log`) passes
    through `clean` first (`core.phrases.error_phrase`): mitmproxy quotes the bytes a
    peer sent when they do not parse, and a peer may send a key or a token."""
    load_engine()
    from mitmproxy.proxy import server

    _log_phrase.setdefault("original", server.ConnectionHandler.log)
    _log_phrase["clean"] = clean
    server.ConnectionHandler.log = _log  # type: ignore[method-assign]


def close_mitmproxy_connection(proxyserver: Any, client_id: str,
                               write: bytes | None = None) -> bool:
    """Close mitmproxy's connection of client `client_id` and, through it, everything it
    opened upstream (after writing `write` to the client, e.g. a refusal). False if
    the connection is gone. `proxyserver` is the gateway's own Proxyserver addon (not
    `ctx.master`'s: that is the last master built, another gateway's in a process that
    runs several)."""
    handler = proxyserver.connections.get(client_id)
    if handler is None:
        return False
    io = handler.transports.get(handler.client)
    if write is not None and io is not None and io.writer is not None:
        io.writer.write(write)
    # Every upstream's writer is closed now, not when the handler ends: the layers may
    # still yield data for it after this call (mitmproxy sends a streamed request's end
    # after its body filter refused it), and a closing writer takes none of it, so the
    # upstream never reads a refused request as complete.
    for conn, transport in list(handler.transports.items()):
        if conn is not handler.client and transport.writer is not None \
                and not transport.writer.is_closing():
            transport.writer.close()
    # Closing the client ends the handler, which closes every upstream it opened.
    handler.close_connection(handler.client)
    return True


def close_mitmproxy_server(proxyserver: Any, client_id: str, server: object) -> None:
    """Close one upstream connection mitmproxy holds for client `client_id`."""
    handler = proxyserver.connections.get(client_id)
    if handler is not None and server in handler.transports:
        handler.close_connection(server)


# -- mitmproxy: a streamed request body refused part-way ends its own stream --------------

STREAM_REFUSED = "sandbox-gateway-stream-refused"  # flow.metadata: the refusal to send
_stream_body: dict[str, Any] = {}


def install_stream_refusal() -> None:
    """A request body filter (`flow.request.stream`) that refuses part-way puts the
    refusal (an `http.Response`) in `flow.metadata[STREAM_REFUSED]` and returns no
    chunk; mitmproxy's streaming state (`HttpStream.state_stream_request_body`) then
    ends that stream alone (`_refused_stream_body`). Without it the only way out was
    closing the client's whole connection, every HTTP/2 stream on it."""
    load_engine()
    from mitmproxy.proxy.layers import http as layers_http

    _stream_body.setdefault("original", layers_http.HttpStream.state_stream_request_body)
    layers_http.HttpStream.state_stream_request_body = _refused_stream_body  # type: ignore[method-assign]


def _refused_stream_body(self: Any, event: Any) -> Any:
    """mitmproxy's own state, run as it is, until the filter it calls refuses: from then
    on nothing it yields goes out (not the rest of the body, not the request's end or
    its `request` hook), and the stream is refused (`_refuse_stream`)."""
    flow = self.flow
    inner = _stream_body["original"](self, event)
    reply: Any = None
    try:
        while True:
            command = inner.send(reply)
            if STREAM_REFUSED in flow.metadata:
                inner.close()
                break
            reply = yield command
    except StopIteration as stop:
        if STREAM_REFUSED not in flow.metadata:
            return stop.value
    yield from _refuse_stream(self, flow.metadata.pop(STREAM_REFUSED))
    return None


HEAD_REFUSED = "sandbox-gateway-head-refused"  # flow.metadata: the answer sent instead
_response_head: dict[str, Any] = {}


def install_head_refusal() -> None:
    """An upstream's answer refused at its head (the `responseheaders` hook puts the
    refusal, an `http.Response`, in `flow.metadata[HEAD_REFUSED]`) is answered at once:
    mitmproxy's state (`HttpStream.state_wait_for_response_headers`) stops after the
    hook, nothing of the upstream's answer goes to the client, the upstream's request is
    cut (an HTTP/2 stream reset, an HTTP/1 connection closed) and the client gets the
    refusal whole (`_refused_head`). Without it the refusal's body waited for the
    upstream's first body bytes, and its end for the upstream's, drained unread: an
    upstream that then stalled or trickled held the client."""
    load_engine()
    from mitmproxy.proxy.layers import http as layers_http

    _response_head.setdefault("original",
                              layers_http.HttpStream.state_wait_for_response_headers)
    layers_http.HttpStream.state_wait_for_response_headers = _refused_head  # type: ignore[method-assign]


def _refused_head(self: Any, event: Any) -> Any:
    """mitmproxy's own state, run as it is, until the `responseheaders` hook refused the
    answer: then nothing more of it runs, and the stream is refused with the answer the
    hook left (`_refuse_stream`, the upstream's head counting as no answer sent)."""
    flow = self.flow
    inner = _response_head["original"](self, event)
    reply: Any = None
    try:
        while True:
            command = inner.send(reply)
            reply = yield command
            if HEAD_REFUSED in flow.metadata:  # (the reply: the hook ran)
                inner.close()
                break
    except StopIteration as stop:
        return stop.value
    flow.response = None  # (the upstream's head: none of it went to the client)
    yield from _refuse_stream(self, flow.metadata.pop(HEAD_REFUSED),
                              "the answer was refused by the gateway")
    return None


def _refuse_stream(self: Any, response: Any,
                   reason: str = "the request was refused by the gateway") -> Any:
    """The upstream's request cut off (an HTTP/2 upstream's stream reset, an HTTP/1
    upstream's connection closed: it never reads the request as complete); the client
    gets `response` on the stream if nothing of an answer went to it yet, else the
    stream is reset (RST_STREAM; an HTTP/1 client's connection closed, the body cut
    off); the stream is dropped, an HTTP/2 connection goes on."""
    from mitmproxy.proxy.layers.http import DropStream, SendHttp
    from mitmproxy.proxy.layers.http._events import (
        ErrorCode,
        RequestProtocolError,
        ResponseData,
        ResponseEndOfMessage,
        ResponseHeaders,
        ResponseProtocolError,
    )

    yield SendHttp(RequestProtocolError(self.stream_id, reason, ErrorCode.KILL),
                   self.context.server)
    if self.flow.response is None:
        self.flow.response = response
        content = response.raw_content
        yield SendHttp(ResponseHeaders(self.stream_id, response, not content),
                       self.context.client)
        if content:
            yield SendHttp(ResponseData(self.stream_id, content), self.context.client)
            yield SendHttp(ResponseEndOfMessage(self.stream_id), self.context.client)
    else:
        yield SendHttp(ResponseProtocolError(self.stream_id, reason, ErrorCode.KILL),
                       self.context.client)
    self.flow.live = False
    self.client_state = self.server_state = self.state_errored
    yield DropStream(self.stream_id)


# -- mitmproxy: TLS 1.3 session tickets to a client held until its first answer ---------

_HELD = "_sandbox_gateway_held_tickets"  # a ClientTLSLayer's: None undecided, b"" done
_client_tls: dict[str, Any] = {}


def install_ticket_hold() -> None:
    """mitmproxy's client-facing TLS sends its TLS 1.3 session tickets as soon as the
    client's Finished is in (pyOpenSSL has no `num_tickets` to turn them off). They then
    reach a client that may be writing its request from another thread: the websockets
    sync client (the OpenAI SDK's Realtime client among its users) reads and writes one
    SSLSocket from two, which OpenSSL does not allow; now and then the write of the
    upgrade request and the read of a ticket collide and the session stalls: the
    upgrade was never answered (3 handshakes in 3,000 under load; none with the tickets
    held). As the HTTP/1 engine does (`net/tls.py`), the tickets are held
    until the first bytes this side sends (the answer, or HTTP/2's SETTINGS) and go in
    front of them, in the same write; a close sends them first."""
    load_engine()
    from mitmproxy.proxy.layers import tls as layers_tls

    _client_tls.setdefault("close", layers_tls.ClientTLSLayer.send_close)
    layers_tls.ClientTLSLayer.tls_interact = _client_tls_interact  # type: ignore[method-assign]
    layers_tls.ClientTLSLayer.send_close = _client_tls_close  # type: ignore[method-assign]


def _client_tls_interact(self: Any) -> Any:
    """mitmproxy's `TLSLayer.tls_interact` (send what OpenSSL wrote), except that what
    a TLS 1.3 session writes once its handshake is over, before anything was sent on
    it (its session tickets, nothing else), is held (`install_ticket_hold`)."""
    from mitmproxy.proxy.commands import SendData
    from OpenSSL import SSL

    out = bytearray()
    while True:
        try:
            out += self.tls.bio_read(65535)
        except SSL.WantReadError:
            break
    held: bytes | None = getattr(self, _HELD, None)
    conn = self.conn
    if held is None and conn.timestamp_tls_setup is not None:  # the handshake is over
        if out and conn.tls_version == "TLSv1.3" and not self.is_dtls:
            setattr(self, _HELD, bytes(out))
            return
        setattr(self, _HELD, b"")
    elif held:
        if not out:
            return  # (still nothing to answer with)
        out[:0] = held  # the tickets first: their records come first in the stream
        setattr(self, _HELD, b"")
    if out:
        yield SendData(conn, bytes(out))


def _client_tls_close(self: Any, command: Any) -> Any:
    """mitmproxy's close of a client TLS layer, held tickets sent first."""
    from mitmproxy.proxy.commands import SendData

    held: bytes | None = getattr(self, _HELD, None)
    if held:
        setattr(self, _HELD, b"")
        yield SendData(self.conn, held)
    yield from _client_tls["close"](self, command)


# -- aiohttp: the gateway's own client through the upstream proxy ------------------------

def proxied_connector(proxy: Any) -> Callable[..., Any]:
    """A factory of aiohttp connectors whose connections go through `proxy` (an
    `UpstreamProxy`) to the address aiohttp resolved (`network.resolve`, then DNS), the
    request's name kept for TLS, unless the proxy's no_proxy says direct; aiohttp's
    error translation kept. (aiohttp is imported here, at the first session.)"""

    def make(**options: Any) -> Any:
        return _connector_class()(proxy, **options)

    return make


@functools.cache
def _connector_class() -> type:
    import ssl

    import aiohttp

    from gateway.core.addresses import Pinned
    from gateway.core.names import normalize_host

    class ProxiedConnector(aiohttp.TCPConnector):
        def __init__(self, proxy: Any, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._proxy = proxy

        async def _wrap_create_connection(self, *args: Any, addr_infos: list[Any], req: Any,
                                          timeout: Any, client_error: Any = None,
                                          **kw: Any) -> Any:
            error = client_error or aiohttp.ClientConnectorError
            sockaddr = addr_infos[0][4]
            pinned = Pinned(normalize_host(str(req.url.raw_host)), int(req.url.port),
                            str(sockaddr[0]), trusted=True, dial_port=int(sockaddr[1]))
            if not self._proxy.applies(pinned.host, pinned.ip, pinned.port):
                return await super()._wrap_create_connection(
                    *args, addr_infos=addr_infos, req=req, timeout=timeout, client_error=error,
                    **kw)
            tls = kw.get("ssl")
            try:
                return await self._proxy.open(
                    pinned, args[0], timeout=timeout.sock_connect or timeout.total or 30.0,
                    tls=tls if isinstance(tls, ssl.SSLContext) else None,
                    server_hostname=kw.get("server_hostname") or pinned.host)
            except ssl.SSLCertVerificationError as exc:
                raise aiohttp.ClientConnectorCertificateError(req.connection_key, exc) from exc
            except ssl.SSLError as exc:
                raise aiohttp.ClientConnectorSSLError(req.connection_key, exc) from exc
            except OSError as exc:
                raise error(req.connection_key, exc) from exc

    return ProxiedConnector


# -- mitmproxy: an upstream's TLS handshake, response head and body within network.timeouts

READ_TIMEOUT = "sandbox-gateway-read-timeout"  # flow.metadata: a ReadTimeout
HANDSHAKE_OPTION = "sandbox_gateway_handshake_timeout"  # a mitmproxy option (seconds)


class ReadTimeout(NamedTuple):
    """network.timeouts.read for one flow (`flow.metadata[READ_TIMEOUT]`): `answer(flow)`
    the answer to a request whose response head did not come in `seconds`; `cut(flow)`
    audits a response whose body paused that long after its head went to the client."""

    seconds: float
    answer: Callable[[Any], Any]
    cut: Callable[[Any], None]


def add_handshake_option(opts: Any, seconds: float) -> None:
    """network.timeouts.handshake as an option of a gateway's mitmproxy (`opts`, its
    `Options`), read by the server TLS layer `install_upstream_timeouts` patches. Added
    here, not by an addon's `load`: the adapter's hooks are its decisions alone, each
    behind its fail-closed wrapper (tests/integration/test_fail_closed.py)."""
    opts.add_option(HANDSHAKE_OPTION, float, seconds,
                    "network.timeouts.handshake, for upstream TLS handshakes")
_ARMED = "_sandbox_gateway_wakeup"  # a layer's own RequestWakeup (a deadline), if armed
_waits: dict[str, Any] = {}


def install_upstream_timeouts(handshake_error: Callable[[str, float], str]) -> None:
    """mitmproxy bounds no wait on an upstream (only its 600 s idle timeout ends one);
    the gateway's `network.timeouts` are armed as mitmproxy's own timers
    (`RequestWakeup`, which the layers route back to the layer that asked):

    - handshake: a server TLS handshake not done `HANDSHAKE_OPTION` seconds after it
      began fails with `handshake_error(address, seconds)` as its error (what the flow's
      error and the client's error answer then carry), the connection closed;
    - read: a request sent whole whose flow carries `READ_TIMEOUT` (a `ReadTimeout`)
      and has no response head that many seconds later is refused as a refused request
      body is (`_refuse_stream`): the client gets the answer on its stream, an HTTP/2
      upstream's stream is reset (the connection and its other streams go on), an
      HTTP/1 upstream's connection closed. Any response head (a 101 too) ends that
      wait; a wakeup that comes after is dropped;
    - read, in a streamed response body (every exchange's: the adapter filters it): the
      same timer, moved on by each part of the body the upstream sends, bounds each
      pause; one that lasts `seconds` cuts the response off as the HTTP/1 engine does
      (the head went out, the answer cannot be replaced): `cut(flow)` audits it, the
      client's HTTP/1 connection is closed (a cut-off body) or its HTTP/2 stream reset,
      and the upstream's likewise. A WebSocket (after its 101) has no such timer.

    A timer whose wait ended is called off (`_call_off`): its task ends at once and the
    layers let go of the layer that armed it (mitmproxy's own wakeups cannot be called
    off: each would keep its flow, the request body among it, and a task for `read`
    seconds after the response). (The TCP connect is bounded by the adapter's dial,
    `mitm._timed_dial`.)"""
    load_engine()
    from mitmproxy.proxy import server
    from mitmproxy.proxy.events import Wakeup
    from mitmproxy.proxy.layers import http as layers_http
    from mitmproxy.proxy.layers import tls as layers_tls
    from mitmproxy.proxy.layers.http import _events

    stream = layers_http.HttpStream
    _waits["handshake_error"] = handshake_error
    if "stream_event" in _waits:
        return
    _waits["wakeup_event"] = Wakeup
    _waits["from_upstream"] = (_events.ResponseHeaders, _events.ResponseData,
                               _events.ResponseTrailers)
    _waits["wakeup"] = server.ConnectionHandler.wakeup
    server.ConnectionHandler.wakeup = _wakeup  # type: ignore[method-assign]
    _waits["stream_event"] = stream._handle_event
    _waits["passthrough"] = stream.passthrough
    _waits["consume"] = stream.state_consume_request_body
    _waits["stream_body"] = stream.state_stream_request_body
    _waits["tls_start"] = layers_tls.ServerTLSLayer.start_handshake
    _waits["tls_event"] = layers_tls.ServerTLSLayer._handle_event
    stream._handle_event = _stream_event  # type: ignore[method-assign]
    stream.passthrough = _stream_passthrough  # type: ignore[method-assign]
    stream.state_consume_request_body = _sent("consume")  # type: ignore[method-assign]
    stream.state_stream_request_body = _sent("stream_body")  # type: ignore[method-assign]
    layers_tls.ServerTLSLayer.start_handshake = _tls_start  # type: ignore[method-assign]
    layers_tls.ServerTLSLayer._handle_event = _tls_event  # type: ignore[method-assign]


@functools.cache
def _deadline() -> Any:
    load_engine()
    from mitmproxy.proxy.commands import RequestWakeup

    class Deadline(RequestWakeup):
        """A layer's (`owner`) `RequestWakeup` that it can call off (`_call_off`) or move
        on (`due`, a `time.monotonic()`, set later: one task for all of a body's pauses)."""

        def __init__(self, delay: float, owner: Any) -> None:
            super().__init__(delay)
            self.owner = owner
            self.off = False
            self.due = time.monotonic() + delay
            self.waiter: asyncio.Future[None] | None = None

    return Deadline


def _arm(layer: Any, seconds: float) -> Any:
    command = layer.__dict__[_ARMED] = _deadline()(seconds, layer)
    return command


def _call_off(layer: Any) -> None:
    """The wait `layer` armed a timer for ended: the timer's task ends now, unheard, and
    the HTTP layers that would route its wakeup back forget the layer."""
    command = layer.__dict__.pop(_ARMED, None)
    if command is None or command.off:
        return
    command.off = True
    if command.waiter is not None and not command.waiter.done():
        command.waiter.set_result(None)
    for parent in layer.context.layers:
        sources = getattr(parent, "command_sources", None)  # (HttpLayer's)
        if isinstance(sources, dict):
            sources.pop(command, None)


async def _wakeup(self: Any, request: Any) -> None:
    """mitmproxy's `ConnectionHandler.wakeup`, except that a `Deadline` called off ends
    at once, without its `Wakeup` event, and one moved on waits until its new `due`."""
    from mitmproxy.proxy.events import Wakeup

    if not isinstance(request, _deadline()):
        await _waits["wakeup"](self, request)
        return
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    try:
        while not request.off and (left := request.due - time.monotonic()) > 0:
            request.waiter = loop.create_future()
            try:
                async with asyncio.timeout(left):
                    await request.waiter
            except TimeoutError:
                pass
    finally:
        self.wakeup_timer.discard(task)
    if not request.off:
        await self.server_event(Wakeup(request))


def _own_wakeup(layer: Any, event: Any) -> bool:
    """The wakeup of a timer `layer` armed (still armed or not: one called off may have
    fired while the layer waited for a hook, and come in after)."""
    from mitmproxy.proxy import events

    return isinstance(event, events.Wakeup) and getattr(event.command, "owner", None) is layer


def _sent(state: str) -> Callable[..., Any]:
    """A request body state of mitmproxy's, then (the request sent whole) the read timer."""
    def run(self: Any, event: Any) -> Any:
        from mitmproxy.proxy.layers.http._events import RequestEndOfMessage

        yield from _waits[state](self, event)
        wait = self.flow.metadata.get(READ_TIMEOUT)
        if isinstance(event, RequestEndOfMessage) and wait is not None and wait[0] > 0 \
                and _awaits_head(self) and _ARMED not in self.__dict__:
            yield _arm(self, wait[0])

    return run


def _awaits_head(self: Any) -> bool:
    return bool(self.client_state == self.state_done
                and self.server_state == self.state_wait_for_response_headers
                and self.flow.response is None and self.flow.live)


def _in_body(self: Any) -> bool:
    """A streamed response body under way (its head went to the client)."""
    return bool(self.server_state == self.state_stream_response_body and self.flow.live)


def _stream_event(self: Any, event: Any) -> Any:
    """mitmproxy's `HttpStream._handle_event`, then the read timer: kept while the head
    is awaited, moved on by each event from the upstream while the body streams, called
    off otherwise; its wakeup is the read timer's (mitmproxy itself sends a stream none:
    any other would have failed its event check)."""
    if isinstance(event, _waits["wakeup_event"]):
        yield from _read_timed_out(self, event)
        return
    yield from _waits["stream_event"](self, event)
    command = self.__dict__.get(_ARMED)
    if command is None:
        if _in_body(self):  # (the head came while the request was still being sent)
            wait = self.flow.metadata.get(READ_TIMEOUT)
            if wait is not None and wait[0] > 0:
                yield _arm(self, wait[0])
        return
    if _awaits_head(self):
        return
    if not _in_body(self):
        _call_off(self)  # (the response ended, or the stream did)
    elif isinstance(event, _waits["from_upstream"]):
        command.due = time.monotonic() + command.delay  # (bytes from the upstream)


def _read_timed_out(self: Any, event: Any) -> Any:
    """The read timer of this stream ran out: a response head awaited is answered
    (`ReadTimeout.answer`), a body under way cut off (`ReadTimeout.cut`); one moved on
    while its wakeup waited for a hook is armed again for what is left."""
    from mitmproxy import flow
    from mitmproxy.proxy.layers.http._hooks import HttpErrorHook

    command = self.__dict__.get(_ARMED)
    if event.command is not command:
        return  # (called off: it fired while this stream waited for a hook)
    del self.__dict__[_ARMED]
    head = _awaits_head(self)
    if not head and not _in_body(self):
        return
    if command.due > time.monotonic():
        again = _arm(self, command.delay)  # (`delay`: the whole period, for moving on)
        again.due = command.due
        yield again
        return
    wait = self.flow.metadata.pop(READ_TIMEOUT, None)
    if wait is None:
        return
    if head:
        response = wait.answer(self.flow)  # the adapter's answer (it audits the exchange)
        self.flow.error = flow.Error(f"no response within {wait.seconds:g}s")
    else:
        response = None
        wait.cut(self.flow)  # (the adapter audits the exchange)
        self.flow.error = flow.Error(f"no response body bytes within {wait.seconds:g}s")
    yield HttpErrorHook(self.flow)  # (what counts flows in flight hears it ended)
    yield from _refuse_stream(self, response, self.flow.error.msg)


def _stream_passthrough(self: Any, event: Any) -> Any:
    """mitmproxy's `HttpStream.passthrough` (a WebSocket after its 101), except the read
    timer's wakeup of this stream, which comes after the response ended the wait."""
    if _own_wakeup(self, event):
        return
    yield from _waits["passthrough"](self, event)


def _tls_start(self: Any) -> Any:
    """mitmproxy's server TLS handshake start, then the handshake timer."""
    from mitmproxy.proxy.tunnel import TunnelState

    yield from _waits["tls_start"](self)
    seconds = getattr(self.context.options, HANDSHAKE_OPTION, 0.0)
    if seconds > 0 and self.tunnel_state is TunnelState.ESTABLISHING \
            and _ARMED not in self.__dict__:
        yield _arm(self, seconds)


def _tls_event(self: Any, event: Any) -> Any:
    """mitmproxy's server TLS layer, except the handshake timer's wakeup: a handshake
    still under way fails as one the upstream broke off does (its error what
    `handshake_error` says), and the connection is closed."""
    from mitmproxy.proxy.tunnel import TunnelState

    if not _own_wakeup(self, event):
        yield from _waits["tls_event"](self, event)
        if _ARMED in self.__dict__ and self.tunnel_state is not TunnelState.ESTABLISHING:
            _call_off(self)  # (done, or failed)
        return
    if self.__dict__.get(_ARMED) is not event.command:
        return  # (called off: it fired while this layer waited for a hook)
    del self.__dict__[_ARMED]
    if self.tunnel_state is not TunnelState.ESTABLISHING:
        return
    address = self.conn.address
    where = f"{address[0]}:{address[1]}" if address else "?"
    err = _waits["handshake_error"](where, getattr(self.context.options, HANDSHAKE_OPTION))
    yield from self.on_handshake_error(err)
    yield from self._handshake_finished(err)
