"""What a connection's first bytes are: a TLS ClientHello (server name, ALPN), an HTTP
request head (Host), or something else — read once, by the doors, for the gate.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.engines.patches import client_hello, parse_request_head, starts_like_tls

__all__ = ["MAX_FIRST", "FirstBytes", "classify"]

MAX_FIRST = 64 * 1024


@dataclass(frozen=True, slots=True)
class FirstBytes:
    """`kind`: tls, http or tcp. `name`: the SNI (tls) or Host header (http)."""

    kind: str
    name: str | None = None
    alpn: tuple[bytes, ...] = ()

    @property
    def http1(self) -> bool:
        """TLS that the HTTP/1 engine can serve: HTTP/1.1 offered, or no ALPN at all."""
        return not self.alpn or b"http/1.1" in self.alpn


def classify(data: bytes, *, http: bool = True) -> FirstBytes | None:
    """Classify a connection's first bytes; None while more are needed. A broken
    ClientHello is `tls` without a name; bytes that start neither TLS nor (with
    `http`) an HTTP request line are `tcp`."""
    if len(data) < 3:
        return None
    if starts_like_tls(data):
        try:
            hello = client_hello(data)
        except ValueError:
            return FirstBytes("tls")
        if hello is None:
            return None if len(data) < MAX_FIRST else FirstBytes("tls")
        return FirstBytes("tls", *hello)
    if http and data[:3].isalpha():
        end = data.find(b"\r\n\r\n")
        if end < 0:
            return None if len(data) < MAX_FIRST else FirstBytes("http")
        try:  # (the HTTP/1 engine's parser: a head it would refuse names no host here)
            head = parse_request_head(data[:end + 4])
        except ValueError:
            return FirstBytes("http")
        host = next((v for k, v in head.fields if k.lower() == b"host"), None)
        return FirstBytes("http", host.decode("latin-1") if host is not None else None)
    return FirstBytes("tcp")
