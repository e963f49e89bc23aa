"""Destination checks: classify the addresses a host resolves to.

Everything here is pure and fast: `AddressPolicy` compiles its ranges into
longest-prefix tables once, and `classify()` runs per upstream connection.

Precedence in `AddressPolicy.classify` (first match decides):

1. the gateway's own listening addresses -> `deny_self_connection` (nothing opens them,
   not allow rules, not operator-trusted overrides);
2. "hard" built-in ranges (link-local incl. cloud metadata, multicast, unspecified,
   0/8, 240/4 incl. broadcast) -> never opened;
3. address rules (`ip:port` beats `ip`; deny beats allow at equal specificity);
4. longest-prefix match over built-in special ranges and `allow_cidrs`/`deny_cidrs`
   together: a more specific range wins, a user rule beats a built-in one of the same
   prefix, a deny beats an allow of the same prefix. So `allow_cidrs: [0.0.0.0/0]`
   does not open 10.0.0.0/8: a private range is opened by naming it or a range inside it;
5. nothing matched -> `allow_default`.

IPv4-mapped IPv6 (`::ffff:a.b.c.d`) is classified as the IPv4 address it maps to.
Other IPv6 forms that embed IPv4 (NAT64, 6to4, Teredo, IPv4-compatible,
IPv4-translated) are refused as `deny_ipv6_embedding`, even wrapping a public address;
an operator may open one with `allow_cidrs`, and then the embedded IPv4 is still checked.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from gateway.core.names import DestinationError, IPAddress, parse_port, split_host_port

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

__all__ = [
    "ALLOW_DEFAULT",
    "ALLOW_USER_CONFIGURED",
    "DENY_CGNAT",
    "DENY_IPV6_EMBEDDING",
    "DENY_NOT_GLOBAL_UNICAST",
    "DENY_PRIVATE_RANGE",
    "DENY_SELF_CONNECTION",
    "DENY_USER_CONFIGURED",
    "PRIVATE_RANGES",
    "AddressPolicy",
    "Pinned",
    "Verdict",
    "embedded_ipv4",
    "parse_address_rule",
    "parse_ip",
    "special_literal",
]

# --------------------------------------------------------------------------------------
# Address classification
# --------------------------------------------------------------------------------------

ALLOW_DEFAULT: Final = "allow_default"
ALLOW_USER_CONFIGURED: Final = "allow_user_configured"
DENY_PRIVATE_RANGE: Final = "deny_private_range"
DENY_CGNAT: Final = "deny_cgnat"
DENY_NOT_GLOBAL_UNICAST: Final = "deny_not_global_unicast"
DENY_IPV6_EMBEDDING: Final = "deny_ipv6_embedding"
DENY_USER_CONFIGURED: Final = "deny_user_configured"
DENY_SELF_CONNECTION: Final = "deny_self_connection"


@dataclass(frozen=True, slots=True)
class Verdict:
    """The classification of one (address, port): allowed or not, a stable code, and a
    sentence a person can act on."""

    allowed: bool
    code: str
    reason: str


@dataclass(frozen=True, slots=True)
class _Range:
    network: IPNetwork
    code: str
    label: str
    hard: bool = False  # never opened, even by allow_cidrs or allow_addresses


def _r(cidr: str, code: str, label: str, hard: bool = False) -> _Range:
    return _Range(ipaddress.ip_network(cidr), code, label, hard)


_NG = DENY_NOT_GLOBAL_UNICAST
_EMB = DENY_IPV6_EMBEDDING

#: RFC 1918 and IPv6 unique-local: the ranges "blocklist mode" opens.
PRIVATE_RANGES: Final = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")

# IANA special-purpose registries (IPv4 and IPv6), minus the globally reachable entries.
_BUILTIN: Final[tuple[_Range, ...]] = (
    _r("10.0.0.0/8", DENY_PRIVATE_RANGE, "private range"),
    _r("172.16.0.0/12", DENY_PRIVATE_RANGE, "private range"),
    _r("192.168.0.0/16", DENY_PRIVATE_RANGE, "private range"),
    _r("fc00::/7", DENY_PRIVATE_RANGE, "private (unique-local) range"),
    _r("100.64.0.0/10", DENY_CGNAT, "carrier-grade NAT range"),
    _r("0.0.0.0/8", _NG, "'this network' (unspecified)", hard=True),
    _r("127.0.0.0/8", _NG, "loopback"),
    _r("169.254.0.0/16", _NG, "link-local", hard=True),
    _r("169.254.169.254/32", _NG, "link-local (cloud metadata)", hard=True),
    _r("169.254.170.2/32", _NG, "link-local (container metadata)", hard=True),
    _r("100.100.100.200/32", _NG, "cloud metadata", hard=True),
    _r("192.0.0.0/24", _NG, "IETF protocol assignments"),
    _r("192.0.2.0/24", _NG, "documentation (TEST-NET-1)"),
    _r("192.88.99.0/24", _NG, "deprecated 6to4 relay anycast"),
    _r("198.18.0.0/15", _NG, "benchmarking"),
    _r("198.51.100.0/24", _NG, "documentation (TEST-NET-2)"),
    _r("203.0.113.0/24", _NG, "documentation (TEST-NET-3)"),
    _r("224.0.0.0/4", _NG, "multicast", hard=True),
    _r("240.0.0.0/4", _NG, "reserved", hard=True),
    _r("255.255.255.255/32", _NG, "limited broadcast", hard=True),
    _r("::/128", _NG, "unspecified", hard=True),
    _r("::1/128", _NG, "loopback"),
    _r("::/96", _EMB, "IPv4-compatible IPv6"),
    _r("::ffff:0:0:0/96", _EMB, "IPv4-translated IPv6"),
    _r("64:ff9b::/96", _EMB, "NAT64"),
    _r("64:ff9b:1::/48", _EMB, "local-use NAT64"),
    _r("100::/64", _NG, "discard-only"),
    _r("2001::/32", _EMB, "Teredo"),
    _r("2001:2::/48", _NG, "benchmarking"),
    _r("2001:10::/28", _NG, "ORCHID"),
    _r("2001:20::/28", _NG, "ORCHIDv2"),
    _r("2001:db8::/32", _NG, "documentation"),
    _r("2002::/16", _EMB, "6to4"),
    _r("3fff::/20", _NG, "documentation"),
    _r("5f00::/16", _NG, "segment-routing SID"),
    _r("fd00:ec2::254/128", _NG, "cloud metadata", hard=True),
    _r("fe80::/10", _NG, "link-local", hard=True),
    _r("fec0::/10", _NG, "deprecated site-local"),
    _r("ff00::/8", _NG, "multicast", hard=True),
)

_MAPPED: Final = ipaddress.IPv6Network("::ffff:0:0/96")
_LOOPBACK_V4: Final = ipaddress.IPv4Network("127.0.0.0/8")
_ANY_PORT: Final = -1


def parse_ip(value: str | IPAddress) -> IPAddress:
    """Parse an address for classification; IPv4-mapped IPv6 becomes its IPv4 address.

    Accepts brackets and zone ids (dropped) but not the loose inet_aton forms: resolved
    addresses and configured rules are always in standard notation.
    """
    if isinstance(value, str):
        return _parse_text(value)[0]
    if isinstance(value, ipaddress.IPv6Address) and value.ipv4_mapped is not None:
        return value.ipv4_mapped
    return value


@functools.lru_cache(maxsize=8192)
def _parse_text(value: str) -> tuple[IPAddress, bool]:
    """(address, was it IPv4-mapped); cached: the same few addresses recur constantly."""
    text = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    text = text.split("%", 1)[0]
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        raise DestinationError(f"invalid IP address {value!r}") from None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped, True
    return addr, text != value


def embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address wrapped in an IPv6 address (mapped, translated, compatible,
    NAT64 with a /96 prefix, 6to4, Teredo client), or None."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if int(ip) <= 1:  # :: and ::1 are not IPv4-compatible addresses
        return None
    for net in _EMBED_LOW32:
        if ip in net:
            return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


_EMBED_LOW32: Final = tuple(
    ipaddress.IPv6Network(n)
    for n in ("::/96", "::ffff:0:0:0/96", "64:ff9b::/96", "64:ff9b:1::/48")
)


def parse_address_rule(rule: str) -> tuple[IPAddress, int | None]:
    """Parse an address rule: `ip`, `ip:port`, `[v6]:port`, `[v6]` or bare `v6`."""
    text = rule.strip()
    port: int | None = None
    if text.startswith("["):
        if text.endswith("]"):
            host = text
        else:
            host, port_text = split_host_port(text)
            port = parse_port(port_text, text)
    elif text.count(":") == 1:
        host, port_text = split_host_port(text)
        port = parse_port(port_text, text)
    else:
        host = text
    return parse_ip(host), port


def _canonical_network(cidr: str | IPNetwork) -> IPNetwork:
    """A rule network; an IPv4-mapped IPv6 range becomes the IPv4 range it maps."""
    try:
        net = ipaddress.ip_network(cidr, strict=False) if isinstance(cidr, str) else cidr
    except ValueError:
        raise DestinationError(f"invalid CIDR {cidr!r}") from None
    if isinstance(net, ipaddress.IPv6Network) and net.prefixlen >= 96 and net.subnet_of(_MAPPED):
        base = ipaddress.IPv4Address(int(net.network_address) & 0xFFFFFFFF)
        return ipaddress.IPv4Network((base, net.prefixlen - 96))
    return net


@dataclass(frozen=True, slots=True)
class _Rule:
    network: IPNetwork
    allowed: bool
    code: str
    label: str  # built-in range label, or the config key of a user rule
    user: bool
    text: str = ""  # str(network), precomputed for reasons

    def __post_init__(self) -> None:
        object.__setattr__(self, "text", str(self.network))


class _PrefixTable:
    """Longest-prefix match over a few hundred networks: one dict lookup per distinct
    prefix length, longest first (IPv4 and IPv6 kept apart)."""

    __slots__ = ("_lens", "_maps")

    def __init__(self) -> None:
        self._maps: dict[int, dict[int, dict[int, _Rule]]] = {4: {}, 6: {}}
        self._lens: dict[int, tuple[int, ...]] = {4: (), 6: ()}

    def add(self, rule: _Rule) -> None:
        """Add (or replace: later wins for the same network) a rule."""
        net = rule.network
        bits = net.max_prefixlen
        by_len = self._maps[net.version].setdefault(net.prefixlen, {})
        by_len[int(net.network_address) >> (bits - net.prefixlen)] = rule
        self._lens[net.version] = tuple(sorted(self._maps[net.version], reverse=True))

    def lookup(self, version: int, value: int) -> _Rule | None:
        bits = 32 if version == 4 else 128
        maps = self._maps[version]
        for plen in self._lens[version]:
            rule = maps[plen].get(value >> (bits - plen))
            if rule is not None:
                return rule
        return None


def _as_pairs(items: Iterable[str | tuple[str, int]]) -> list[tuple[IPAddress, int]]:
    out: list[tuple[IPAddress, int]] = []
    for item in items:
        if isinstance(item, str):
            ip, port = parse_address_rule(item)
            if port is None:
                raise DestinationError(f"own address {item!r} needs a port")
            out.append((ip, port))
        else:
            out.append((parse_ip(item[0]), int(item[1])))
    return out


class AddressPolicy:
    """Classifies (resolved IP, port) pairs; see the module docstring for precedence.

    - allow_cidrs / deny_cidrs: operator ranges (network.allow_cidrs / deny_cidrs).
    - allow_addresses / deny_addresses: `ip` or `ip:port` rules; they beat any range.
    - own_addresses: (ip, port) pairs the gateway listens on (or "ip:port"); never
      allowable. A wildcard listener (0.0.0.0 or ::) covers loopback, the unspecified
      address and every address in `local_addresses` (the host's interface addresses,
      see `local_interface_addresses()` in gateway.net.resolver) on that port.
    - unsafe_allow_private_ranges: "blocklist mode" (smokescreen's
      UnsafeAllowPrivateRanges): RFC 1918 and unique-local ranges are allowed unless
      denied; loopback, link-local/metadata, CGNAT and the other special ranges stay denied.
    """

    __slots__ = ("_addr_rules", "_hard", "_local", "_own", "_own_wild_ports", "_table")

    def __init__(
        self,
        allow_cidrs: Iterable[str | IPNetwork] = (),
        deny_cidrs: Iterable[str | IPNetwork] = (),
        allow_addresses: Iterable[str] = (),
        deny_addresses: Iterable[str] = (),
        own_addresses: Iterable[str | tuple[str, int]] = (),
        *,
        local_addresses: Iterable[str] = (),
        unsafe_allow_private_ranges: bool = False,
    ) -> None:
        self._hard = _PrefixTable()
        self._table = _PrefixTable()
        for b in _BUILTIN:
            if unsafe_allow_private_ranges and b.code == DENY_PRIVATE_RANGE:
                continue
            rule = _Rule(b.network, False, b.code, b.label, user=False)
            (self._hard if b.hard else self._table).add(rule)
        for cidr in allow_cidrs:
            net = _canonical_network(cidr)
            self._table.add(_Rule(net, True, ALLOW_USER_CONFIGURED, "network.allow_cidrs", True))
        for cidr in deny_cidrs:
            net = _canonical_network(cidr)
            self._table.add(_Rule(net, False, DENY_USER_CONFIGURED, "network.deny_cidrs", True))
        # (version, int) -> {port or _ANY_PORT: allowed}; denies inserted last win ties.
        self._addr_rules: dict[tuple[int, int], dict[int, bool]] = {}
        for rules, allowed in ((allow_addresses, True), (deny_addresses, False)):
            for text in rules:
                ip, port = parse_address_rule(text)
                key = (ip.version, int(ip))
                self._addr_rules.setdefault(key, {})[_ANY_PORT if port is None else port] = allowed
        self._local: frozenset[tuple[int, int]] = frozenset(
            (a.version, int(a)) for a in map(parse_ip, local_addresses)
        )
        self._own: frozenset[tuple[int, int, int]] = frozenset()
        self._own_wild_ports: frozenset[int] = frozenset()
        self.add_own_addresses(own_addresses)

    def add_own_addresses(self, own_addresses: Iterable[str | tuple[str, int]]) -> None:
        """Register more listening addresses (e.g. once listeners are bound to port 0)."""
        own, wild = set(self._own), set(self._own_wild_ports)
        for ip, port in _as_pairs(own_addresses):
            if ip.is_unspecified:
                wild.add(port)
            else:
                own.add((ip.version, int(ip), port))
        self._own, self._own_wild_ports = frozenset(own), frozenset(wild)

    def is_self(self, ip: str | IPAddress, port: int) -> bool:
        """True if (ip, port) reaches one of the gateway's own listeners."""
        addr = parse_ip(ip)
        return self._is_self(addr, addr.version, int(addr), port)

    def _is_self(self, addr: IPAddress, version: int, value: int, port: int) -> bool:
        if (version, value, port) in self._own:
            return True
        if port in self._own_wild_ports:
            return (
                addr.is_loopback or addr.is_unspecified or (version, value) in self._local
            )
        return False

    def classify_trusted(self, ip: str | IPAddress, port: int) -> Verdict:
        """Classify an operator-trusted target (a `network.resolve` override).

        Range rules are skipped (the operator named this address), but the gateway's own
        listeners and the hard ranges (link-local/cloud metadata, multicast, unspecified,
        reserved) are still refused: an override can never open those.
        """
        addr = parse_ip(ip)
        version, value = addr.version, int(addr)
        if self._is_self(addr, version, value, port) or self._hard.lookup(version, value):
            return self.classify(addr, port)
        return Verdict(
            True,
            ALLOW_USER_CONFIGURED,
            f"{addr} port {port} is an operator-trusted target (network.resolve)",
        )

    def classify(self, ip: str | IPAddress, port: int) -> Verdict:
        """Classify one resolved address and port (fast: table lookups only)."""
        if isinstance(ip, str):
            addr, changed = _parse_text(ip)
            shown = f"{ip} (= {addr})" if changed else ip
        else:
            addr = parse_ip(ip)
            shown = str(addr) if addr is ip else f"{ip} (= {addr})"
        version, value = addr.version, int(addr)
        if self._is_self(addr, version, value, port):
            return Verdict(
                False,
                DENY_SELF_CONNECTION,
                f"{shown} port {port} is one of this gateway's own listening addresses; "
                "the gateway never connects to itself",
            )
        hard = self._hard.lookup(version, value)
        if hard is not None:
            return Verdict(
                False,
                hard.code,
                f"{shown} is a {hard.label} address ({hard.text}); "
                "egress to it is never allowed",
            )
        by_port = self._addr_rules.get((version, value))
        if by_port is not None:
            allowed = by_port.get(port, by_port.get(_ANY_PORT))
            if allowed is not None:
                what = "allow" if allowed else "deny"
                return self._embedded_check(
                    addr,
                    port,
                    Verdict(
                        allowed,
                        ALLOW_USER_CONFIGURED if allowed else DENY_USER_CONFIGURED,
                        f"{shown} port {port} is {what}ed by network.{what}_addresses",
                    ),
                )
        rule = self._table.lookup(version, value)
        if rule is None:
            return Verdict(True, ALLOW_DEFAULT, f"{shown} is a public address")
        if rule.allowed:
            return self._embedded_check(
                addr,
                port,
                Verdict(
                    True, ALLOW_USER_CONFIGURED, f"{shown} is in {rule.text} ({rule.label})"
                ),
            )
        return Verdict(False, rule.code, _deny_reason(shown, rule))

    def _embedded_check(self, addr: IPAddress, port: int, verdict: Verdict) -> Verdict:
        """An operator-opened IPv6 embedding (e.g. NAT64) must not wrap a forbidden IPv4."""
        if not verdict.allowed or not isinstance(addr, ipaddress.IPv6Address):
            return verdict
        inner = embedded_ipv4(addr)
        if inner is None:
            return verdict
        inner_verdict = self.classify(inner, port)
        if inner_verdict.allowed:
            return verdict
        return Verdict(
            False,
            DENY_IPV6_EMBEDDING,
            f"{addr} wraps the IPv4 address {inner}, which is refused: {inner_verdict.reason}",
        )


@dataclass(frozen=True, slots=True)
class Special:
    """A built-in range an IP literal falls in: its label, its CIDR text, and whether
    nothing (policy, allow_cidrs, resolve override) can ever open it."""

    label: str
    cidr: str
    hard: bool


@functools.cache
def _builtin_tables() -> tuple[_PrefixTable, _PrefixTable]:
    hard, soft = _PrefixTable(), _PrefixTable()
    for b in _BUILTIN:
        (hard if b.hard else soft).add(_Rule(b.network, False, b.code, b.label, user=False))
    return hard, soft


def special_literal(host: str) -> Special | None:
    """The built-in special range of an IP literal `host` (canonical text, brackets
    allowed), or None for a public address or a name. Pure: for reasons and hints only;
    the destination check itself is `AddressPolicy.classify`."""
    try:
        addr = parse_ip(host)
    except DestinationError:
        return None
    hard, soft = _builtin_tables()
    for table, is_hard in ((hard, True), (soft, False)):
        rule = table.lookup(addr.version, int(addr))
        if rule is not None:
            return Special(rule.label, rule.text, is_hard)
    return None


def _deny_reason(shown: str, rule: _Rule) -> str:
    if rule.user:
        return f"{shown} is in {rule.text}, listed in {rule.label}"
    opener = "add it to network.allow_cidrs if this sandbox must reach it"
    if rule.code == DENY_PRIVATE_RANGE:
        return f"{shown} is in a {rule.label} ({rule.text}); {opener}"
    if rule.code == DENY_CGNAT:
        return f"{shown} is in the {rule.label} ({rule.text}); {opener}"
    if rule.code == DENY_IPV6_EMBEDDING:
        return (
            f"{shown} is a {rule.label} address ({rule.text}) that wraps an IPv4 address; "
            "it is refused even when the IPv4 address is public. Add the range to "
            "network.allow_cidrs if this network reaches IPv4 through it"
        )
    return f"{shown} is a {rule.label} address ({rule.text}), not a public one; {opener}"


@dataclass(frozen=True, slots=True)
class Pinned:
    """A checked destination: connect to `ip` (port `dial_port`, default `port`) for
    `host:port`. `trusted` means an operator override (network.resolve) chose it."""

    host: str
    port: int
    ip: str
    trusted: bool = False
    dial_port: int | None = None

    @property
    def address(self) -> tuple[str, int]:
        """The (ip, port) actually dialled."""
        return self.ip, self.port if self.dial_port is None else self.dial_port
