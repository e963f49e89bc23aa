"""Host names and authorities: one normaliser for every decision.

Every place that compares or matches a host — the target derivation, the policy
matcher, `policy explain`, the resolver, the admin API — calls `normalize_host`, so
`policy explain` and enforcement can never disagree about what a name is.

Canonical form: lowercase, one trailing dot stripped, IDN labels as punycode
(IDNA 2008 / UTS 46, lenient like browsers), IP literals in any encoding curl or glibc
accept (`2130706433`, `0x7f.1`, `0177.0.0.1`, `[::1]`, zone ids dropped) as canonical
`ipaddress` text. Anything that is not a DNS name or IP literal raises
`DestinationError`. Pure and memoised.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from typing import Final

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

__all__ = [
    "DestinationError",
    "IPAddress",
    "is_ip",
    "normalize_host",
    "parse_authority",
    "parse_host_ip",
    "split_host_port",
]


class DestinationError(ValueError):
    """A host or authority that cannot be a destination (malformed, invalid characters)."""


# --------------------------------------------------------------------------------------
# Host / authority parsing
# --------------------------------------------------------------------------------------

_MISSING_PORT: Final = "missing port in address"
_TOO_MANY_COLONS: Final = "too many colons in address"
_PORT_RANGE: Final = "must be between 0 and 65535"
_PORT_RE: Final = re.compile(r"[+-]?[0-9]+")
# Characters that never appear in a DNS name and that URL parsers treat specially.
_FORBIDDEN_CHARS: Final = frozenset(" \t\r\n@/\\%?#:[]<>\"'^`{|}*!$&()+,;=~")
_LABEL_RE: Final = re.compile(r"[a-z0-9_-]{1,63}")
_NUMERIC_LABEL_RE: Final = re.compile(r"[0-9]+|0[xX][0-9a-fA-F]*")
_ZONE_RE: Final = re.compile(r"[A-Za-z0-9_.\-]+")
_HEX_RE: Final = re.compile(r"[0-9a-fA-F]*")
_OCT_RE: Final = re.compile(r"[0-7]+")
_DEC_RE: Final = re.compile(r"[0-9]+")


def split_host_port(authority: str) -> tuple[str, str]:
    """Split `host:port` like Go's net.SplitHostPort (the conformance source)."""
    i = authority.rfind(":")
    if i < 0:
        raise DestinationError(f"address {authority!r}: {_MISSING_PORT}")
    j = k = 0
    if authority.startswith("["):
        end = authority.find("]")
        if end < 0:
            raise DestinationError(f"address {authority!r}: missing ']' in address")
        if end + 1 == len(authority):
            raise DestinationError(f"address {authority!r}: {_MISSING_PORT}")
        if end + 1 != i:
            if authority[end + 1] == ":":
                raise DestinationError(f"address {authority!r}: {_TOO_MANY_COLONS}")
            raise DestinationError(f"address {authority!r}: {_MISSING_PORT}")
        host = authority[1:end]
        j, k = 1, end + 1
    else:
        host = authority[:i]
        if ":" in host:
            raise DestinationError(f"address {authority!r}: {_TOO_MANY_COLONS}")
    if "[" in authority[j:]:
        raise DestinationError(f"address {authority!r}: unexpected '[' in address")
    if "]" in authority[k:]:
        raise DestinationError(f"address {authority!r}: unexpected ']' in address")
    return host, authority[i + 1 :]


def parse_port(text: str, authority: str) -> int:
    if not _PORT_RE.fullmatch(text):
        raise DestinationError(f"address {authority!r}: port {text!r}: invalid syntax")
    port = int(text)
    if not 0 <= port <= 65535:
        raise DestinationError(f"address {authority!r}: port {text!r}: {_PORT_RANGE}")
    return port


@functools.lru_cache(maxsize=8192)
def parse_authority(authority: str, default_port: int | None = None) -> tuple[str, int]:
    """Parse a CONNECT authority (`host:port`, `[v6]:port`) into a normalised (host, port).

    The host is lowercased, IDN-encoded to punycode and IP literals are put in canonical
    form; a trailing dot on a name is kept (`normalize_host` strips it for matching).
    Without a port, `default_port` is used if given (e.g. a Host header), else an error.
    """
    if default_port is not None and not _has_port(authority):
        bracketed = authority.startswith("[") and authority.endswith("]")
        host = authority[1:-1] if bracketed else authority
        if ":" in host and not authority.startswith("["):
            raise DestinationError(f"address {authority!r}: {_TOO_MANY_COLONS}")
        port = default_port
    else:
        host, port_text = split_host_port(authority)
        port = parse_port(port_text, authority)
    if not host:
        raise DestinationError(f"address {authority!r}: empty host: invalid syntax")
    return _normalize(host, strip_dot=False), port


def _has_port(authority: str) -> bool:
    if authority.startswith("["):
        return "]:" in authority
    return ":" in authority


def is_ip(host: str) -> bool:
    """True if `host` is an IP literal in any encoding curl/glibc would accept."""
    try:
        return parse_host_ip(host) is not None
    except DestinationError:
        return False


def parse_host_ip(host: str) -> IPAddress | None:
    """The address an IP-literal host denotes, or None for a name.

    Accepts `[v6]`, zone ids (stripped: `fe80::1%eth0`, `%25eth0`) and every inet_aton
    IPv4 form (`2130706433`, `0x7f.1`, `0177.0.0.1`, `127.1`). A host whose last label is
    numeric but is no valid IPv4 (`1.2.3.4.5`, `foo.1`) raises DestinationError, as in
    the WHATWG URL standard: it can never be a DNS name.
    """
    if host.startswith("[") or ":" in host:
        return _parse_ipv6(host)
    labels = host.split(".")
    if len(labels) > 1 and labels[-1] == "":
        labels.pop()
    if not labels or not _NUMERIC_LABEL_RE.fullmatch(labels[-1]):
        return None
    return _parse_ipv4_loose(labels, host)


def _parse_ipv6(host: str) -> ipaddress.IPv6Address:
    text = host
    if text.startswith("[") or text.endswith("]"):
        if not (text.startswith("[") and text.endswith("]")):
            raise DestinationError(f"invalid IPv6 literal {host!r}")
        text = text[1:-1]
    if "%" in text:
        text, zone = text.split("%", 1)
        if zone.startswith("25") and len(zone) > 2:
            zone = zone[2:]
        if not _ZONE_RE.fullmatch(zone):
            raise DestinationError(f"invalid zone id in IPv6 literal {host!r}")
    try:
        return ipaddress.IPv6Address(text)
    except ValueError:
        raise DestinationError(f"invalid IPv6 literal {host!r}") from None


def _parse_ipv4_number(part: str, host: str) -> int:
    if part[:2] in ("0x", "0X"):
        digits, base, ok = part[2:], 16, _HEX_RE.fullmatch(part[2:])
    elif len(part) > 1 and part[0] == "0":
        digits, base, ok = part[1:], 8, _OCT_RE.fullmatch(part[1:])
    else:
        digits, base, ok = part, 10, _DEC_RE.fullmatch(part)
    if not ok:
        raise DestinationError(f"invalid IPv4 address {host!r}")
    return int(digits, base) if digits else 0


def _parse_ipv4_loose(labels: list[str], host: str) -> ipaddress.IPv4Address:
    """inet_aton/WHATWG IPv4: 1-4 parts, each decimal, 0x-hex or 0-octal."""
    if len(labels) > 4 or any(not p for p in labels):
        raise DestinationError(f"invalid IPv4 address {host!r}")
    numbers = [_parse_ipv4_number(p, host) for p in labels]
    *head, last = numbers
    if any(n > 255 for n in head) or last >= 256 ** (5 - len(numbers)):
        raise DestinationError(f"invalid IPv4 address {host!r}: a part is out of range")
    value = last
    for i, n in enumerate(head):
        value += n << (8 * (3 - i))
    return ipaddress.IPv4Address(value)


def _to_ascii(host: str) -> str:
    """IDN -> punycode: IDNA 2008 (UTS 46, non-transitional), else lenient UTS 46 like
    browsers (so an emoji label such as 🔐 becomes xn--jv8h as the conformance expects).
    (idna and its tables are imported here, at the first non-ASCII name: ~1.7 MiB.)"""
    import idna

    try:
        return idna.encode(host, uts46=True, transitional=False).decode("ascii")
    except idna.IDNAError:
        pass
    try:
        mapped = idna.uts46_remap(host, std3_rules=False, transitional=False)
        labels = [
            lab if lab.isascii() else "xn--" + lab.encode("punycode").decode("ascii")
            for lab in mapped.split(".")
        ]
    except (idna.IDNAError, UnicodeError):
        raise DestinationError(f"invalid internationalised host name {host!r}") from None
    return ".".join(labels)


def _normalize(host: str, *, strip_dot: bool) -> str:
    if not host:
        raise DestinationError("empty host name")
    if host.startswith("[") or ":" in host:
        return _parse_ipv6(host).compressed
    if any(c in _FORBIDDEN_CHARS or ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in host):
        raise DestinationError(f"invalid character in host name {host!r}")
    ascii_host = host.lower() if host.isascii() else _to_ascii(host).lower()
    ip = parse_host_ip(ascii_host)
    if ip is not None:
        return ip.compressed
    name = ascii_host[:-1] if ascii_host.endswith(".") else ascii_host
    if len(name) > 253:
        raise DestinationError(f"host name too long ({len(name)} > 253 characters)")
    for label in name.split("."):
        if not _LABEL_RE.fullmatch(label):
            what = "empty label" if not label else "invalid label"
            raise DestinationError(f"{what} {label!r} in host name {host!r}")
    return name if strip_dot else ascii_host


@functools.lru_cache(maxsize=8192)
def normalize_host(host: str) -> str:
    """Canonical form of a host for matching and checking (memoised: it runs several
    times per request on the same few names; errors are not cached).

    Lowercase, one trailing dot stripped, IDN as punycode, IP literals in any encoding
    as canonical `ipaddress` text (zone ids dropped). Raises DestinationError for
    anything that is not a valid DNS name or IP literal.
    """
    return _normalize(host, strip_dot=True)
