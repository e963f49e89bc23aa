"""Address classification (pure, table-driven)."""

from __future__ import annotations

import ipaddress
import time

import pytest

from gateway.core.addresses import AddressPolicy, embedded_ipv4, parse_address_rule, parse_ip
from gateway.core.names import DestinationError, IPAddress

# ----------------------------------------------------------------------------- classification

DEFAULT = AddressPolicy()


@pytest.mark.parametrize(
    ("ip", "code"),
    [
        ("8.8.8.8", "allow_default"),
        ("2606:4700:4700::1111", "allow_default"),
        ("::ffff:8.8.8.8", "allow_default"),
        ("10.1.2.3", "deny_private_range"),
        ("172.31.255.255", "deny_private_range"),
        ("172.32.0.1", "allow_default"),
        ("fd12::1", "deny_private_range"),
        ("100.64.0.1", "deny_cgnat"),
        ("127.0.0.53", "deny_not_global_unicast"),
        ("0.0.0.0", "deny_not_global_unicast"),
        ("169.254.169.254", "deny_not_global_unicast"),
        ("224.0.0.251", "deny_not_global_unicast"),
        ("255.255.255.255", "deny_not_global_unicast"),
        ("192.0.0.170", "deny_not_global_unicast"),
        ("192.0.2.1", "deny_not_global_unicast"),
        ("198.19.255.255", "deny_not_global_unicast"),
        ("198.51.100.1", "deny_not_global_unicast"),
        ("203.0.113.1", "deny_not_global_unicast"),
        ("240.0.0.1", "deny_not_global_unicast"),
        ("::", "deny_not_global_unicast"),
        ("::1", "deny_not_global_unicast"),
        ("fe80::1%eth0", "deny_not_global_unicast"),
        ("[fe80::1]", "deny_not_global_unicast"),
        ("ff02::1", "deny_not_global_unicast"),
        ("2001:db8::1", "deny_not_global_unicast"),
        ("fd00:ec2::254", "deny_not_global_unicast"),
        ("::ffff:127.0.0.1", "deny_not_global_unicast"),
        ("::ffff:10.0.0.1", "deny_private_range"),
        ("::ffff:169.254.169.254", "deny_not_global_unicast"),
        ("::8.8.8.8", "deny_ipv6_embedding"),
        ("::ffff:0:808:808", "deny_ipv6_embedding"),
        ("64:ff9b::a9fe:a9fe", "deny_ipv6_embedding"),
        ("64:ff9b:1::1", "deny_ipv6_embedding"),
        ("2002:c0a8:1::1", "deny_ipv6_embedding"),
        ("2001::1", "deny_ipv6_embedding"),
    ],
)
def test_default_classification(ip: str, code: str) -> None:
    verdict = DEFAULT.classify(ip, 443)
    assert verdict.code == code, verdict
    assert verdict.allowed is code.startswith("allow_")


def test_reasons_are_actionable() -> None:
    meta = DEFAULT.classify("169.254.169.254", 80).reason
    assert meta == (
        "169.254.169.254 is a link-local (cloud metadata) address (169.254.169.254/32); "
        "egress to it is never allowed"
    )
    private = DEFAULT.classify("10.0.0.5", 443).reason
    assert private == (
        "10.0.0.5 is in a private range (10.0.0.0/8); "
        "add it to network.allow_cidrs if this sandbox must reach it"
    )
    assert "maps to" not in private
    mapped = DEFAULT.classify("::ffff:10.0.0.5", 443).reason
    assert mapped.startswith("::ffff:10.0.0.5 (= 10.0.0.5) is in a private range")
    assert "6to4" in DEFAULT.classify("2002:808:808::1", 443).reason


def test_longest_prefix_decides_between_user_and_builtin() -> None:
    p = AddressPolicy(allow_cidrs=["0.0.0.0/0", "10.1.0.0/16", "172.16.0.0/12"],
                      deny_cidrs=["10.1.2.0/24", "8.8.0.0/16"])
    assert p.classify("10.9.9.9", 1).code == "deny_private_range"  # /0 opens no special range
    assert p.classify("10.1.9.9", 1).code == "allow_user_configured"
    assert p.classify("10.1.2.9", 1).code == "deny_user_configured"
    assert p.classify("172.20.0.1", 1).code == "allow_user_configured"  # equal prefix: user wins
    assert p.classify("8.8.8.8", 1).code == "deny_user_configured"
    assert p.classify("9.9.9.9", 1).code == "allow_user_configured"
    same = AddressPolicy(allow_cidrs=["10.0.0.0/8"], deny_cidrs=["10.0.0.0/8"])
    assert same.classify("10.0.0.1", 1).code == "deny_user_configured"  # equal: deny wins


def test_address_rules_beat_ranges_and_port_specific_beats_any_port() -> None:
    p = AddressPolicy(
        allow_cidrs=["192.168.0.0/16"],
        deny_addresses=["192.168.1.5", "8.8.8.8:25"],
        allow_addresses=["192.168.1.5:8443", "10.0.0.1", "[fd00::1]:443"],
    )
    assert p.classify("192.168.1.5", 443).code == "deny_user_configured"
    assert p.classify("192.168.1.5", 8443).code == "allow_user_configured"
    assert p.classify("8.8.8.8", 25).code == "deny_user_configured"
    assert p.classify("10.0.0.1", 22).code == "allow_user_configured"
    assert p.classify("fd00::1", 443).allowed and not p.classify("fd00::1", 80).allowed
    both = AddressPolicy(allow_addresses=["10.0.0.1:1"], deny_addresses=["10.0.0.1:1"])
    assert both.classify("10.0.0.1", 1).code == "deny_user_configured"


def test_hard_ranges_cannot_be_opened() -> None:
    p = AddressPolicy(
        allow_cidrs=["169.254.0.0/16", "224.0.0.0/4", "fe80::/10", "0.0.0.0/8"],
        allow_addresses=["169.254.169.254:80"],
    )
    for ip in ("169.254.169.254", "169.254.1.1", "224.0.0.1", "fe80::1", "0.0.0.0"):
        assert not p.classify(ip, 80).allowed, ip
    assert "never allowed" in p.classify("169.254.1.1", 80).reason


def test_soft_ranges_open_with_allow_cidrs() -> None:
    p = AddressPolicy(allow_cidrs=["127.0.0.0/8", "::1/128", "100.64.0.0/10", "fc00::/7"])
    for ip in ("127.0.0.2", "::1", "100.64.1.1", "fd00::1", "::ffff:127.0.0.2"):
        assert p.classify(ip, 80).code == "allow_user_configured", ip


def test_mapped_rules_become_ipv4_rules() -> None:
    p = AddressPolicy(allow_cidrs=["::ffff:10.0.0.0/104"], deny_addresses=["::ffff:8.8.8.8"])
    assert p.classify("10.2.3.4", 1).code == "allow_user_configured"
    assert p.classify("8.8.8.8", 1).code == "deny_user_configured"


def test_opened_nat64_still_checks_the_embedded_ipv4() -> None:
    p = AddressPolicy(allow_cidrs=["64:ff9b::/96", "2002::/16"])
    assert p.classify("64:ff9b::808:808", 443).code == "allow_user_configured"
    inner = p.classify("64:ff9b::a9fe:a9fe", 443)
    assert inner.code == "deny_ipv6_embedding" and "169.254.169.254" in inner.reason
    assert p.classify("64:ff9b::a00:1", 443).code == "deny_ipv6_embedding"
    assert p.classify("2002:0a00:0001::1", 443).code == "deny_ipv6_embedding"
    assert p.classify("2002:0808:0808::1", 443).allowed


def test_embedded_ipv4() -> None:
    v6 = ipaddress.IPv6Address
    assert embedded_ipv4(v6("64:ff9b::808:808")) == ipaddress.IPv4Address("8.8.8.8")
    assert embedded_ipv4(v6("2002:808:808::1")) == ipaddress.IPv4Address("8.8.8.8")
    assert str(embedded_ipv4(v6("2001:0:4136:e378:8000:63bf:3fff:fdd2"))) == "192.0.2.45"
    assert embedded_ipv4(v6("::ffff:1.2.3.4")) == ipaddress.IPv4Address("1.2.3.4")
    assert embedded_ipv4(v6("::1")) is None
    assert embedded_ipv4(v6("2606:4700::1")) is None


def test_blocklist_mode() -> None:
    p = AddressPolicy(unsafe_allow_private_ranges=True)
    assert p.classify("10.0.0.1", 1).code == "allow_default"
    assert p.classify("fd00::1", 1).code == "allow_default"
    for ip in ("127.0.0.1", "100.64.0.1", "169.254.169.254", "64:ff9b::a00:1"):
        assert not p.classify(ip, 1).allowed, ip


def test_self_connection() -> None:
    p = AddressPolicy(
        allow_cidrs=["0.0.0.0/0", "127.0.0.0/8", "192.168.0.0/16"],
        allow_addresses=["127.0.0.1:8090"],
        own_addresses=[("127.0.0.1", 8090), "0.0.0.0:8080", "[::]:8081"],
        local_addresses=["192.168.7.7", "2001:4860::7"],
    )
    deny = "deny_self_connection"
    assert p.classify("127.0.0.1", 8090).code == deny  # admin: nothing opens it
    assert p.classify("::ffff:127.0.0.1", 8090).code == deny
    assert p.classify("127.0.0.1", 8091).code == "allow_user_configured"
    for ip in ("127.0.0.1", "127.9.9.9", "::1", "0.0.0.0", "192.168.7.7", "2001:4860::7"):
        assert p.classify(ip, 8080).code == deny, ip
        assert p.classify(ip, 8081).code == deny, ip
    assert p.classify("192.168.7.8", 8080).code == "allow_user_configured"
    assert p.is_self("127.0.0.1", 8090) and not p.is_self("8.8.8.8", 8090)
    p.add_own_addresses([("10.0.0.9", 9000)])
    assert p.classify("10.0.0.9", 9000).code == deny
    assert "own listening addresses" in p.classify("10.0.0.9", 9000).reason
    with pytest.raises(DestinationError, match="needs a port"):
        AddressPolicy(own_addresses=["127.0.0.1"])


def test_classify_trusted() -> None:
    p = AddressPolicy(own_addresses=[("127.0.0.1", 8090)], deny_cidrs=["10.0.0.0/8"])
    assert p.classify_trusted("10.0.0.5", 443).code == "allow_user_configured"
    assert p.classify_trusted("127.0.0.1", 8090).code == "deny_self_connection"
    assert p.classify_trusted("169.254.169.254", 80).code == "deny_not_global_unicast"


def test_parse_rules_and_ips() -> None:
    assert parse_address_rule("10.0.0.1:321") == (ipaddress.IPv4Address("10.0.0.1"), 321)
    assert parse_address_rule("[::1]:80") == (ipaddress.IPv6Address("::1"), 80)
    assert parse_address_rule("[::1]") == (ipaddress.IPv6Address("::1"), None)
    assert parse_address_rule("2001:db8::1") == (ipaddress.IPv6Address("2001:db8::1"), None)
    assert parse_ip("::ffff:1.2.3.4") == ipaddress.IPv4Address("1.2.3.4")
    for bad in ("10.0.0.1:x", "example.com", "10.0.0.1:70000"):
        with pytest.raises(DestinationError):
            parse_address_rule(bad)
    with pytest.raises(DestinationError, match="invalid CIDR"):
        AddressPolicy(allow_cidrs=["10.0.0.0/33"])
    with pytest.raises(DestinationError):
        DEFAULT.classify("0x7f.1", 80)  # resolved addresses are always standard notation


def test_classify_is_fast() -> None:
    p = AddressPolicy(
        allow_cidrs=[f"10.{i}.0.0/16" for i in range(200)],
        deny_cidrs=[f"8.{i}.0.0/16" for i in range(200)],
        own_addresses=[("127.0.0.1", 8080)],
    )
    addrs: list[IPAddress] = [
        ipaddress.IPv4Address("8.8.8.8"),
        ipaddress.IPv6Address("2606:4700::1"),
        ipaddress.IPv4Address("10.5.1.1"),
    ]
    n = 20_000
    start = time.perf_counter()
    for i in range(n):
        p.classify(addrs[i % 3], 443)
    per_call = (time.perf_counter() - start) / n
    assert per_call < 50e-6, f"{per_call * 1e6:.1f} µs per classify"


@pytest.mark.parametrize(
    ("host", "want"),
    [
        ("169.254.169.254", ("link-local (cloud metadata)", "169.254.169.254/32", True)),
        ("[fe80::1]", ("link-local", "fe80::/10", True)),
        ("::ffff:169.254.169.254", ("link-local (cloud metadata)", "169.254.169.254/32", True)),
        ("224.0.0.1", ("multicast", "224.0.0.0/4", True)),
        ("10.1.2.3", ("private range", "10.0.0.0/8", False)),
        ("127.0.0.1", ("loopback", "127.0.0.0/8", False)),
        ("8.8.8.8", None),
        ("metadata.google.internal", None),
    ],
)
def test_special_literal(host: str, want: tuple[str, str, bool] | None) -> None:
    from gateway.core.addresses import special_literal

    found = special_literal(host)
    assert (None if found is None else (found.label, found.cidr, found.hard)) == want
    if found is not None:  # agrees with the destination check
        verdict = DEFAULT.classify(host.strip("[]"), 80)
        assert not verdict.allowed
        assert ("never allowed" in verdict.reason) == found.hard
