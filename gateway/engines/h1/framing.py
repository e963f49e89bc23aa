"""HTTP/1 framing for the engine: heads in and out, body lengths, hop-by-hop fields.

Heads are parsed by h11's strict parsers (`patches`), then checked for what a proxy
must refuse on top: versions other than 1.0/1.1, and a message that carries both
`Transfer-Encoding` and `Content-Length` (the request-smuggling shape: a server and a
proxy that pick different lengths see different requests). Hop-by-hop fields belong to
one connection and are not forwarded; the engine frames each side itself.
"""

from __future__ import annotations

from gateway.core.messages import Headers, RequestHead, ResponseHead
from gateway.engines.patches import RawRequest, RawResponse

__all__ = [
    "HOP_BY_HOP",
    "ProtocolError",
    "forward_fields",
    "request_body_size",
    "request_head",
    "response_body_size",
    "response_head",
    "serialize_request",
    "serialize_response",
]

HOP_BY_HOP = frozenset((b"connection", b"keep-alive", b"proxy-connection", b"te",
                        b"transfer-encoding", b"content-length", b"upgrade",
                        b"proxy-authorization", b"proxy-authenticate", b"trailer"))
_VERSIONS = {b"1.1": "HTTP/1.1", b"1.0": "HTTP/1.0"}


class ProtocolError(Exception):
    """The peer sent something that is not valid HTTP/1 (answered 400 / 502, closed)."""


def _version(raw: bytes) -> str:
    version = _VERSIONS.get(raw)
    if version is None:
        raise ProtocolError(f"HTTP/{raw[:8].decode('latin-1')} is not supported; "
                            "send HTTP/1.1")
    return version


def _no_smuggling(headers: Headers) -> None:
    if headers.count("transfer-encoding") and headers.count("content-length"):
        raise ProtocolError("the message has both Transfer-Encoding and Content-Length "
                            "(a request smuggling shape); send one of them")


def request_head(event: RawRequest) -> RequestHead:
    headers = Headers(event.fields)
    _no_smuggling(headers)
    return RequestHead(event.method.decode("latin-1"), event.target.decode("latin-1"),
                       headers, _version(event.http_version), names_checked=True)


def response_head(event: RawResponse) -> ResponseHead:
    headers = Headers(event.fields)
    _no_smuggling(headers)
    return ResponseHead(event.status_code, event.reason.decode("latin-1"), headers,
                        _version(event.http_version))


def request_body_size(head: RequestHead) -> int | None:
    """Content-Length, 0 for no body, None for chunked (h11 validated both fields)."""
    if head.headers.get("transfer-encoding") is not None:
        return None
    length = head.headers.get("content-length")
    return int(length) if length is not None else 0


def response_body_size(method: str, head: ResponseHead) -> int | None:
    """Content-Length, None for chunked, -1 for until-close (RFC 9112 section 6.3)."""
    status = head.status
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return 0
    if head.headers.get("transfer-encoding") is not None:
        return None
    length = head.headers.get("content-length")
    return int(length) if length is not None else -1


def forward_fields(headers: Headers, *, keep_upgrade: bool = False) -> list[tuple[bytes, bytes]]:
    """The fields to forward: without hop-by-hop ones (those `Connection` names too)."""
    named = {t.strip().lower().encode("latin-1")
             for v in headers.get_all("connection") for t in v.split(",") if t.strip()}
    drop = HOP_BY_HOP | named
    if keep_upgrade:
        drop = drop - {b"upgrade"}
    return headers.without(drop)


def _fields(fields: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join([b"%s: %s\r\n" % field for field in fields])


def serialize_request(head: RequestHead, size: int | None, *, upgrade: bool) -> bytes:
    """The request head for the upstream: origin-form, HTTP/1.1, framed by `size`."""
    fields = forward_fields(head.headers, keep_upgrade=upgrade)
    if upgrade:
        fields.append((b"Connection", b"Upgrade"))
    if size is None:
        fields.append((b"Transfer-Encoding", b"chunked"))
    elif size or head.method in ("POST", "PUT", "PATCH"):
        fields.append((b"Content-Length", b"%d" % size))
    line = f"{head.method} {head.target} HTTP/1.1\r\n".encode("latin-1")
    return line + _fields(fields) + b"\r\n"


def serialize_response(head: ResponseHead, *, chunked: bool, length: int | None,
                       close: bool, upgrade: bool = False) -> bytes:
    """The response head for the client, framed as decided by the engine."""
    fields = forward_fields(head.headers, keep_upgrade=upgrade)
    if upgrade:
        fields.append((b"Connection", b"Upgrade"))
    elif close:
        fields.append((b"Connection", b"close"))
    if chunked:
        fields.append((b"Transfer-Encoding", b"chunked"))
    elif length is not None:
        fields.append((b"Content-Length", b"%d" % length))
    reason = head.reason.encode("latin-1") if head.reason else b""
    return b"HTTP/1.1 %d %s\r\n" % (head.status, reason) + _fields(fields) + b"\r\n"
