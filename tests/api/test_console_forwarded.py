"""How the console reads a request behind a reverse proxy (gateway/api/console/forwarded.py),
table-driven: forwarded headers are believed from `console.trusted_proxies` only, and only
as one well-formed value."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from gateway.api.console.forwarded import TrustedProxies


def _request(peer: str, headers: list[tuple[str, str]], host: str = "10.0.0.9:8090"
             ) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/console/login",
                    "scheme": "http", "server": ("10.0.0.9", 8090), "client": (peer, 41000),
                    "query_string": b"", "root_path": "",
                    "headers": [(b"host", host.encode())] + [
                        (k.lower().encode(), v.encode()) for k, v in headers]})


TLS = [("X-Forwarded-Proto", "https"), ("X-Forwarded-Host", "console.example.com"),
       ("X-Forwarded-For", "203.0.113.7")]

# (case, trusted, peer, headers, origin seen, client seen)
CASES = [
    ("no proxy", ("127.0.0.1", "::1"), "10.0.0.1", [], "http://10.0.0.9:8090", "10.0.0.1"),
    ("a trusted proxy", ("10.1.0.0/16",), "10.1.2.3", TLS,
     "https://console.example.com", "203.0.113.7"),
    ("an untrusted peer's headers are ignored", ("10.1.0.0/16",), "10.2.0.1", TLS,
     "http://10.0.0.9:8090", "10.2.0.1"),
    ("the default trusts loopback", ("127.0.0.1", "::1"), "127.0.0.1", TLS,
     "https://console.example.com", "203.0.113.7"),
    ("::1 by default too", ("127.0.0.1", "::1"), "::1", TLS,
     "https://console.example.com", "203.0.113.7"),
    ("127.0.0.2 is not 127.0.0.1", ("127.0.0.1", "::1"), "127.0.0.2", TLS,
     "http://10.0.0.9:8090", "127.0.0.2"),
    ("an IPv4-mapped peer", ("10.1.0.0/16",), "::ffff:10.1.0.5", TLS,
     "https://console.example.com", "203.0.113.7"),
    ("a port in X-Forwarded-Host", ("10.1.2.3",), "10.1.2.3",
     [("X-Forwarded-Proto", "https"), ("X-Forwarded-Host", "console.example.com:8443")],
     "https://console.example.com:8443", "10.1.2.3"),
    ("only the proto", ("10.1.2.3",), "10.1.2.3", [("X-Forwarded-Proto", "HTTPS")],
     "https://10.0.0.9:8090", "10.1.2.3"),
    ("a list of protos is no answer", ("10.1.2.3",), "10.1.2.3",
     [("X-Forwarded-Proto", "https, http")], "http://10.0.0.9:8090", "10.1.2.3"),
    ("two proto lines are no answer", ("10.1.2.3",), "10.1.2.3",
     [("X-Forwarded-Proto", "https"), ("X-Forwarded-Proto", "https")],
     "http://10.0.0.9:8090", "10.1.2.3"),
    ("a proto that is not http(s)", ("10.1.2.3",), "10.1.2.3",
     [("X-Forwarded-Proto", "javascript")], "http://10.0.0.9:8090", "10.1.2.3"),
    ("a host that is not a host", ("10.1.2.3",), "10.1.2.3",
     [("X-Forwarded-Proto", "https"), ("X-Forwarded-Host", "evil.example/x@y")],
     "https://10.0.0.9:8090", "10.1.2.3"),
    ("a host list", ("10.1.2.3",), "10.1.2.3",
     [("X-Forwarded-Host", "a.example, b.example")], "http://10.0.0.9:8090", "10.1.2.3"),
    ("an IPv6 host", ("10.1.2.3",), "10.1.2.3", [("X-Forwarded-Host", "[2001:db8::1]:8443")],
     "http://[2001:db8::1]:8443", "10.1.2.3"),
    ("the client is the last hop no trusted proxy added", ("10.1.0.0/16",), "10.1.2.3",
     [("X-Forwarded-For", "198.51.100.1, 203.0.113.7, 10.1.9.9")], "http://10.0.0.9:8090",
     "203.0.113.7"),
    ("a hop that is no address: the peer", ("10.1.0.0/16",), "10.1.2.3",
     [("X-Forwarded-For", "unknown")], "http://10.0.0.9:8090", "10.1.2.3"),
]


@pytest.mark.parametrize(("case", "trusted", "peer", "headers", "origin", "client"), CASES,
                         ids=[c[0] for c in CASES])
def test_forwarded_headers_are_believed_from_trusted_proxies_only(
        case: str, trusted: tuple[str, ...], peer: str, headers: list[tuple[str, str]],
        origin: str, client: str) -> None:
    seen = TrustedProxies(trusted).seen(_request(peer, headers))
    assert (seen.origin, seen.client) == (origin, client)
