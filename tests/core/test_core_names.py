"""Host normalisation and authority parsing: the one normaliser (pure, table-driven)."""

from __future__ import annotations

import ipaddress

import pytest

from gateway.core import target
from gateway.core.names import (
    DestinationError,
    is_ip,
    normalize_host,
    parse_authority,
    parse_host_ip,
)
from gateway.core.policy import hosts

# ----------------------------------------------------------------------------- hosts

NORMALISED = [
    ("Example.COM", "example.com"),
    ("example.com.", "example.com"),
    ("🔐.example.com", "xn--jv8h.example.com"),
    ("тест.example.com", "xn--e1aybc.example.com"),
    ("Bücher.DE", "xn--bcher-kva.de"),
    ("faß.de", "xn--fa-hia.de"),  # IDNA 2008, not the 2003 "fass.de"
    ("_dmarc.example.com", "_dmarc.example.com"),
    # IPv4 in every inet_aton form resolves to the address glibc/curl would dial.
    ("127.0.0.1", "127.0.0.1"),
    ("2130706433", "127.0.0.1"),
    ("0x7f000001", "127.0.0.1"),
    ("0X7F000001", "127.0.0.1"),
    ("0177.0.0.1", "127.0.0.1"),
    ("0x7f.1", "127.0.0.1"),
    ("127.1", "127.0.0.1"),
    ("127.0.1", "127.0.0.1"),
    ("127.0.0.1.", "127.0.0.1"),
    ("0", "0.0.0.0"),
    ("0251.0376.0251.0376", "169.254.169.254"),
    ("0xa9fea9fe", "169.254.169.254"),
    ("169.254.43518", "169.254.169.254"),
    ("127。0。0。1", "127.0.0.1"),  # ideographic full stops (UTS 46 maps them to ".")
    ("\uff11\uff12\uff17.0.0.1", "127.0.0.1"),  # fullwidth digits
    # IPv6: brackets, case, mapped forms, zone ids.
    ("[::1]", "::1"),
    ("::1", "::1"),
    ("[0:0:0:0:0:0:0:1]", "::1"),
    ("[::ffff:127.0.0.1]", "::ffff:7f00:1"),
    ("::ffff:7f00:1", "::ffff:7f00:1"),
    ("[2001:DB8::1]", "2001:db8::1"),
    ("fe80::1%25eth0", "fe80::1"),
    ("fe80::1%eth0", "fe80::1"),
    ("[fe80::1%25eth0]", "fe80::1"),
]


@pytest.mark.parametrize(("host", "want"), NORMALISED)
def test_normalize_host(host: str, want: str) -> None:
    assert normalize_host(host) == want


REFUSED_HOSTS = [
    "", ".", "a..b", ".example.com", "example.com..", "a b.example", "a\tb", "evil.com@good.com",
    "a/b", "a\\b", "a%2eb", "a?b", "a#b", "a:b", "a\x00b", "a\x7fb", "exa\u0085mple.com",
    "1.2.3.4.5", "foo.1", "example.0x10", "256.1.1.1", "1.2.3.256", "1.16777216",
    "08.0.0.1", "0x1g.0.0.1", "[::1", "::1]", "[1.2.3.4]", "[::1%]", "fe80::1%e/th0",
    "::ffff:0177.0.0.1", "a" * 64 + ".com", ("a" * 60 + ".") * 5 + "com",
    "*.example.com",
]


@pytest.mark.parametrize("host", REFUSED_HOSTS)
def test_normalize_host_refuses(host: str) -> None:
    with pytest.raises(DestinationError):
        normalize_host(host)


def test_destination_error_is_value_error() -> None:
    assert issubclass(DestinationError, ValueError)


@pytest.mark.parametrize(
    ("host", "want"),
    [("127.1", True), ("[::1]", True), ("fe80::1%eth0", True), ("example.com", False),
     ("1.2.3.4.5", False), ("0x", True), ("0xg", False), ("a1", False)],
)
def test_is_ip(host: str, want: bool) -> None:
    assert is_ip(host) is want


def test_parse_host_ip() -> None:
    assert parse_host_ip("example.com") is None
    assert parse_host_ip("0x7f.1") == ipaddress.IPv4Address("127.0.0.1")


# ----------------------------------------------------------------------------- authorities


@pytest.mark.parametrize(
    ("authority", "default", "want"),
    [
        ("Example.COM:443", None, ("example.com", 443)),
        ("example.com.:443", None, ("example.com.", 443)),
        ("0x7f.1:80", None, ("127.0.0.1", 80)),
        ("[::FFFF:127.0.0.1]:80", None, ("::ffff:7f00:1", 80)),
        ("example.com", 443, ("example.com", 443)),
        ("example.com:8443", 443, ("example.com", 8443)),
        ("[2001:db8::1]", 443, ("2001:db8::1", 443)),
        ("example.com:+80", None, ("example.com", 80)),
        ("example.com:0", None, ("example.com", 0)),
        ("example.com:65535", None, ("example.com", 65535)),
    ],
)
def test_parse_authority(authority: str, default: int | None, want: tuple[str, int]) -> None:
    assert parse_authority(authority, default) == want


@pytest.mark.parametrize(
    ("authority", "default", "message"),
    [
        ("example.com:", None, "invalid syntax"),
        ("example.com:https", None, "invalid syntax"),
        ("example.com:65536", None, "must be between 0 and 65535"),
        (":443", None, "empty host"),
        ("[::1]x:443", None, "missing port"),
        ("[::1]:1:2", None, "too many colons"),
        ("[::1:443", None, "missing ']'"),
        ("a]:443", None, "unexpected ']'"),
        ("a[b:443", None, "unexpected '\\['"),
        ("2001:db8::1", 443, "too many colons"),
        ("user@example.com:443", None, "invalid character"),
        ("example.com:", 443, "invalid syntax"),
    ],
)
def test_parse_authority_errors(authority: str, default: int | None, message: str) -> None:
    with pytest.raises(DestinationError, match=message):
        parse_authority(authority, default)




# Finding 6 of the enforcement-core issue: the policy layer and enforcement once had
# two normalisers that disagreed on these. There is one now; the policy layer uses it.
ONCE_DISAGREED = [
    ("2130706433", "127.0.0.1"),
    ("0177.0.0.1", "127.0.0.1"),
    ("fe80::1%eth0", "fe80::1"),
    ("a\u200db.example.com", "xn--ab-m1t.example.com"),
    ("\u2488example.com", None),
    (" example.com", None),
]


@pytest.mark.parametrize(("host", "want"), ONCE_DISAGREED)
def test_policy_layer_and_enforcement_share_one_normaliser(host: str, want: str | None) -> None:
    assert hosts.normalize_host is normalize_host
    assert target.normalize_host is normalize_host  # (explain's and test's URLs too)
    if want is None:
        with pytest.raises(DestinationError):
            normalize_host(host)
    else:
        assert normalize_host(host) == want
