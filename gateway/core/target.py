"""Where a request really goes: one derivation from every name the client gives.

A client names its destination several times: the CONNECT authority (or, in
transparent mode, the connection's original address and the name in its first
bytes), the TLS server name (SNI), the request-target in absolute-form, the `Host`
header and HTTP/2's `:authority`. An upstream routes by whichever it reads (a CDN by
SNI, a virtual host by Host, a proxy-aware server by the absolute URL), so every one
of them must name the same host and port, or the request is refused as
`host_mismatch`. The forwarded request line is then always origin-form, built from
the derived target.

Pure: no I/O, no engine types.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.core.messages import RequestHead
from gateway.core.names import DestinationError, is_ip, normalize_host, parse_authority
from gateway.core.refusal import Refusal

__all__ = [
    "DEFAULT_PORTS",
    "Target",
    "check_server_name",
    "request_target",
    "tunnel_authority",
    "url_target",
]

DEFAULT_PORTS = {"http": 80, "https": 443}
_METHOD = re.compile(r"[A-Z][A-Z0-9!#$%&'*+.^_`|~-]*")
_SCHEME_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://([^/?#]*)(.*)", re.S)
_TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_FIELD_NAMES = re.compile(_TOKEN + rb"(?: " + _TOKEN + rb")*")  # names joined by spaces
# Control characters but HTAB, and DEL, in values joined by tabs: deleted by
# `bytes.translate` and the lengths compared (a quarter of a regular expression's time).
_BAD_VALUE = bytes([*range(0x00, 0x09), *range(0x0a, 0x20), 0x7f])
_MAX_SHOWN = 100


@dataclass(frozen=True, slots=True)
class Target:
    """The destination of one request: scheme, normalised host, port, and the
    origin-form request-target to forward (`/path?query`, or `*`)."""

    scheme: str
    host: str
    port: int
    path: str


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def tunnel_authority(authority: str) -> tuple[str, int]:
    """The normalised (host, port) of a CONNECT authority, or Refusal(bad_destination)."""
    try:
        host, port = parse_authority(authority)
        return normalize_host(host), port
    except DestinationError as exc:
        raise Refusal("bad_destination", f"CONNECT target: {exc}") from None


def check_server_name(host: str, sni: str | None, *, passthrough: bool) -> Refusal | None:
    """The TLS server name must be the tunnel's host. A passthrough tunnel to a host
    name must carry one: without SNI the upstream (a CDN, a shared TLS front) picks a
    virtual host the gateway cannot see."""
    if not sni:
        if passthrough and not is_ip(host):
            return Refusal("host_mismatch", f"the TLS ClientHello names no server (SNI) in "
                           f"a tunnel to {host}; clients must send the tunnel's host as SNI")
        return None
    try:
        name = normalize_host(sni)
    except DestinationError:
        name = None
    if name != host:
        return Refusal("host_mismatch", f"the TLS server name {_clip(sni)!r} is not the "
                       f"tunnel's destination {host}; connect to each host through its own "
                       "CONNECT")
    return None


def _authority(text: str, scheme: str, what: str) -> tuple[str, int]:
    if "@" in text:
        raise Refusal("bad_request", f"the {what} {_clip(text)!r} carries user information; "
                      "send credentials in headers, not in the URL's authority")
    try:
        host, port = parse_authority(text, default_port=DEFAULT_PORTS[scheme])
        return normalize_host(host), port
    except DestinationError as exc:
        raise Refusal("host_mismatch" if what != "request URL" else "bad_destination",
                      f"the {what} {_clip(text)!r} is not a valid host: {exc}") from None


def _bad_fields(fields: list[tuple[bytes, bytes]], names_checked: bool) -> bool:
    values = b"\t".join([v for _, v in fields])
    if len(values.translate(None, _BAD_VALUE)) != len(values):
        return True
    if names_checked:
        return False
    joined = b" ".join(k for k, _ in fields)
    return not _FIELD_NAMES.fullmatch(joined) or joined.count(b" ") != len(fields) - 1


def request_target(head: RequestHead, tunnel: tuple[str, int] | None, *, tls: bool) -> Target:
    """The target of `head`, or Refusal. `tunnel`: the (host, port) the connection is
    bound to (CONNECT authority, or the transparent destination); None for a plain
    proxy request, whose target is its absolute URL. `tls`: the client's connection
    is TLS (the request is https)."""
    method = head.method
    if not _METHOD.fullmatch(method):
        raise Refusal("bad_request", f"method {_clip(method)!r} is not an upper-case HTTP "
                      "method token (methods are case-sensitive: send GET, POST, ...)")
    if method == "CONNECT":
        raise Refusal("bad_request", "CONNECT inside a tunnel or as a plain request is not "
                      "supported; open the tunnel with CONNECT to the proxy itself")
    fields = head.headers.fields
    if fields and _bad_fields(fields, head.names_checked):
        raise Refusal("bad_request", "a header field has a name that is not a token or a "
                      "value with control characters (NUL, CR, LF)")
    scheme = "https" if tls else "http"
    raw = head.target
    names: list[tuple[str, str]] = []  # (what, authority text)
    match = _SCHEME_URL.fullmatch(raw) if not raw.startswith("/") else None
    if match is not None:
        url_scheme = match.group(1).lower()
        if url_scheme not in DEFAULT_PORTS:
            raise Refusal("bad_request", f"unsupported URL scheme {url_scheme!r}; use http")
        if tunnel is None:
            if url_scheme != "http":
                raise Refusal("bad_request", "an https:// URL must go through a CONNECT "
                              "tunnel; set HTTPS_PROXY so the client opens one")
            scheme = "http"
        elif url_scheme != scheme:
            raise Refusal("host_mismatch", f"the request URL's scheme {url_scheme} does not "
                          f"match the connection ({scheme})")
        names.append(("request URL", match.group(2)))
        path = match.group(3) or "/"
        if path.startswith("?"):
            path = "/" + path
        if not path.startswith("/") or "#" in path:
            raise Refusal("bad_request", f"invalid request URL {_clip(raw)!r}")
    elif raw.startswith("/") or (raw == "*" and method == "OPTIONS"):
        path = raw
    else:
        raise Refusal("bad_request", f"invalid request-target {_clip(raw)!r}")
    if tunnel is None and match is None:
        raise Refusal("bad_request", "a request to the proxy must carry an absolute URL "
                      "(http://host/path); configure the client's HTTP_PROXY")

    hosts = head.headers.get_all("host")
    if len(hosts) > 1:
        raise Refusal("bad_request", "the request has more than one Host header")
    if hosts:
        names.append(("Host header", hosts[0]))
    elif head.authority is None and head.http_version == "HTTP/1.1":
        raise Refusal("bad_request", "the request has no Host header (HTTP/1.1 requires one)")
    if head.authority is not None:
        names.append((":authority", head.authority))

    if tunnel is not None:
        host, port = tunnel
    else:
        host, port = _authority(names[0][1], scheme, names[0][0])
    for what, text in names:
        got = _authority(text, scheme, what)
        if got != (host, port):
            raise Refusal("host_mismatch", f"the {what} names {_clip(text)!r} but the "
                          f"request goes to {host}:{port}; open a separate connection "
                          "(CONNECT) for each host")
    return Target(scheme, host, port, path)


def url_target(url: str, *, tunnel: bool = False) -> Target:
    """The target of a request for ``url`` as a client would send it (what ``policy
    explain`` and ``policy test`` decide): the authority read as `request_target`
    reads a request URL, the scheme https when none is given, a fragment dropped (no
    client sends one). ``tunnel``: a CONNECT, whose URL may be ``tcp://host:port``
    (path ``""``). Raises Refusal(bad_request)."""
    if "://" not in url:
        url = "https://" + url
    match = _SCHEME_URL.fullmatch(url)
    scheme = match.group(1).lower() if match is not None else ""
    allowed = ("http", "https", "tcp") if tunnel else ("http", "https")
    if match is None or scheme not in allowed:
        raise Refusal("bad_request", f"unsupported URL scheme {scheme!r} in {_clip(url)!r}; "
                      f"use {' or '.join(allowed)}")
    authority = match.group(2)
    try:
        if "@" in authority:
            raise DestinationError("user information in the authority")
        host, port = parse_authority(authority, default_port=DEFAULT_PORTS.get(scheme))
        host = normalize_host(host)
    except DestinationError as exc:
        raise Refusal("bad_request", f"invalid URL {_clip(url)!r}: {exc}") from None
    path = match.group(3).partition("#")[0] or "/"
    if path.startswith("?"):
        path = "/" + path
    if not path.startswith("/"):
        raise Refusal("bad_request", f"invalid URL {_clip(url)!r}")
    return Target(scheme, host, port, "" if tunnel else path)
