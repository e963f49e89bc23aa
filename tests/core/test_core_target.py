"""Target derivation: every name a request gives must agree (table-driven)."""

from __future__ import annotations

import pytest

from gateway.core.messages import Headers, RequestHead
from gateway.core.refusal import Refusal
from gateway.core.target import Target, check_server_name, request_target, tunnel_authority


def head(target: str, *headers: tuple[str, str], method: str = "GET",
         version: str = "HTTP/1.1", authority: str | None = None) -> RequestHead:
    return RequestHead(method, target, Headers.of(*headers), version, authority)


TUNNEL = ("api.example.com", 443)

ALLOWED = [
    # (head, tunnel, tls, expected target)
    (head("/v1/x?y=1", ("Host", "api.example.com")), TUNNEL, True,
     Target("https", "api.example.com", 443, "/v1/x?y=1")),
    (head("/", ("Host", "API.Example.COM.:443")), TUNNEL, True,
     Target("https", "api.example.com", 443, "/")),
    (head("https://api.example.com/v1", ("Host", "api.example.com")), TUNNEL, True,
     Target("https", "api.example.com", 443, "/v1")),
    (head("https://api.example.com?q", ("Host", "api.example.com")), TUNNEL, True,
     Target("https", "api.example.com", 443, "/?q")),
    (head("/", ("Host", "plain.test")), ("plain.test", 80), False,
     Target("http", "plain.test", 80, "/")),
    (head("http://plain.test:8080/a", ("Host", "plain.test:8080")), None, False,
     Target("http", "plain.test", 8080, "/a")),
    (head("http://plain.test/a", version="HTTP/1.0"), None, False,
     Target("http", "plain.test", 80, "/a")),
    (head("/", version="HTTP/1.0"), TUNNEL, True, Target("https", "api.example.com", 443, "/")),
    (head("*", ("Host", "api.example.com"), method="OPTIONS"), TUNNEL, True,
     Target("https", "api.example.com", 443, "*")),
    (head("/h2", ("Host", "api.example.com"), version="HTTP/2.0",
          authority="api.example.com"), TUNNEL, True,
     Target("https", "api.example.com", 443, "/h2")),
    (head("/h2", version="HTTP/2.0", authority="api.example.com:443"), TUNNEL, True,
     Target("https", "api.example.com", 443, "/h2")),
    (head("/", ("Host", "[2001:db8::1]")), ("2001:db8::1", 443), True,
     Target("https", "2001:db8::1", 443, "/")),
]


@pytest.mark.parametrize(("request_head", "tunnel", "tls", "want"), ALLOWED)
def test_targets(request_head: RequestHead, tunnel: tuple[str, int] | None, tls: bool,
                 want: Target) -> None:
    assert request_target(request_head, tunnel, tls=tls) == want


REFUSED = [
    # (head, tunnel, tls, code, words in the reason)
    # absolute-form naming another host inside a tunnel (finding 2)
    (head("https://api.openai.com/x", ("Host", "other.test")), ("other.test", 443), True,
     "host_mismatch", "request URL"),
    (head("https://other.test/x", ("Host", "api.openai.com")), ("other.test", 443), True,
     "host_mismatch", "Host header"),
    (head("/", ("Host", "evil.test")), TUNNEL, True, "host_mismatch", "evil.test"),
    (head("/", ("Host", "api.example.com:8443")), TUNNEL, True, "host_mismatch", "8443"),
    (head("http://api.example.com/", ("Host", "api.example.com")), TUNNEL, True,
     "host_mismatch", "scheme"),
    (head("/h2", ("Host", "api.example.com"), version="HTTP/2.0", authority="evil.test"),
     TUNNEL, True, "host_mismatch", ":authority"),
    (head("/h2", ("Host", "evil.test"), version="HTTP/2.0", authority="api.example.com"),
     TUNNEL, True, "host_mismatch", "Host header"),
    (head("/", ("Host", "a"), ("Host", "b")), TUNNEL, True, "bad_request", "more than one"),
    (head("/"), TUNNEL, True, "bad_request", "no Host"),
    (head("http://plain.test/a"), None, False, "bad_request", "no Host"),  # RFC 9112 3.2
    (head("/", ("Host", "api.example.com"), method="get"), TUNNEL, True, "bad_request",
     "upper-case"),
    (head("/", ("Host", "api.example.com"), method="CONNECT"), TUNNEL, True, "bad_request",
     "CONNECT"),
    (head("/x", ("Host", "plain.test")), None, False, "bad_request", "absolute URL"),
    (head("https://api.example.com/", ("Host", "api.example.com")), None, False,
     "bad_request", "CONNECT"),
    (head("ftp://api.example.com/", ("Host", "api.example.com")), TUNNEL, True,
     "bad_request", "scheme"),
    (head("https://user@api.example.com/", ("Host", "api.example.com")), TUNNEL, True,
     "bad_request", "user information"),
    (head("x", ("Host", "api.example.com")), TUNNEL, True, "bad_request", "request-target"),
    (head("*", ("Host", "api.example.com")), TUNNEL, True, "bad_request", "request-target"),
    (head("/", ("Host", "api.example.com@evil.test")), TUNNEL, True, "bad_request",
     "user information"),
]


@pytest.mark.parametrize(("request_head", "tunnel", "tls", "code", "words"), REFUSED)
def test_refusals(request_head: RequestHead, tunnel: tuple[str, int] | None, tls: bool,
                  code: str, words: str) -> None:
    with pytest.raises(Refusal) as info:
        request_target(request_head, tunnel, tls=tls)
    assert info.value.code == code
    assert words in info.value.reason


@pytest.mark.parametrize(("host", "sni", "passthrough", "code"), [
    ("pass.test", "pass.test", True, None),
    ("pass.test", "PASS.test.", True, None),
    ("pass.test", "evil.test", True, "host_mismatch"),  # domain fronting (finding 10)
    ("pass.test", None, True, "host_mismatch"),  # no SNI: the upstream picks the vhost
    ("pass.test", None, False, None),  # intercepted: every request's Host is checked
    ("10.0.0.1", None, True, None),  # an IP tunnel has no SNI
    ("pass.test", "bad name!", False, "host_mismatch"),
])
def test_server_name(host: str, sni: str | None, passthrough: bool, code: str | None) -> None:
    refusal = check_server_name(host, sni, passthrough=passthrough)
    assert (refusal.code if refusal else None) == code


@pytest.mark.parametrize(("authority", "want"), [
    ("API.example.com:443", ("api.example.com", 443)),
    ("[::1]:8443", ("::1", 8443)),
    ("2130706433:443", ("127.0.0.1", 443)),
])
def test_tunnel_authority(authority: str, want: tuple[str, int]) -> None:
    assert tunnel_authority(authority) == want


@pytest.mark.parametrize("authority", ["example.com", "a b:443", "[::1:443", ":443"])
def test_tunnel_authority_refused(authority: str) -> None:
    with pytest.raises(Refusal) as info:
        tunnel_authority(authority)
    assert info.value.code == "bad_destination"


@pytest.mark.parametrize("field", [("X-N", "a\x00b"), ("X-N", "a\rb"), ("X-N", "a\nb"),
                                   ("Bad Name", "x"), ("X:y", "z"), ("", "z")])
def test_control_characters_and_bad_names_are_refused(field: tuple[str, str]) -> None:
    """Finding 12: a NUL in a header value was forwarded (both engines)."""
    with pytest.raises(Refusal) as info:
        request_target(head("/", ("Host", "api.example.com"), field), TUNNEL, tls=True)
    assert info.value.code == "bad_request"


def test_tabs_and_utf8_in_values_are_fine() -> None:
    request_target(head("/", ("Host", "api.example.com"), ("X-V", "a\tb caf\xe9")), TUNNEL,
                   tls=True)
