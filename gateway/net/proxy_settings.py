"""`network.upstream_proxy`: the corporate proxy the gateway dials through, parsed once.

Pure (no I/O): the config loader builds `ProxySettings` from the config map, or from the
gateway's own environment (`HTTPS_PROXY`, `HTTP_PROXY`, `ALL_PROXY`, `NO_PROXY`) only
when `network.upstream_proxy: env` says so. `NoProxy` decides which destinations are
dialled direct: names (`internal.corp`), suffixes (`.corp`, `*.corp`), addresses and
CIDRs (`10.0.0.0/8`), optionally with a port (`git.corp:22`), or `*` for all.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from gateway.core.names import DestinationError, normalize_host
from gateway.core.secret_value import SecretValue

__all__ = ["CONNECT_TO", "SCHEMES", "NoProxy", "ProxySettings", "from_environment",
           "parse_no_proxy", "parse_proxy_url", "parse_settings"]

SCHEMES = {"http": 80, "https": 443, "socks5": 1080, "socks5h": 1080}
CONNECT_TO = ("address", "name")
_KEYS = ("url", "credentials", "no_proxy", "connect_to", "check_ready")
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class NoProxy:
    """Destinations dialled direct, never through the proxy (see the module docstring)."""

    everything: bool = False
    names: frozenset[str] = frozenset()  # exact names
    suffixes: tuple[str, ...] = ()  # ".corp": the name itself and every name under it
    networks: tuple[Network, ...] = ()
    ported: tuple[tuple[str, int], ...] = ()  # (name or suffix, port)
    entries: tuple[str, ...] = ()  # as written (for messages)

    def matches(self, host: str, ip: str | None, port: int) -> bool:
        """`host` (a normalised name or literal) dialled at `ip`:`port` goes direct. So
        does a link-local address whatever the list says (the node's own: the cloud
        metadata service a managed-identity credential asks; a proxy cannot reach it,
        and sandboxes can never dial one)."""
        if self.everything or _link_local(ip) or _link_local(host):
            return True
        if host in self.names or any(_under(host, s) for s in self.suffixes):
            return True
        for name, only in self.ported:
            if only == port and (host == name or (name.startswith(".") and _under(host, name))):
                return True
        if self.networks:
            for text in (ip, host):
                if text is None:
                    continue
                try:
                    addr = ipaddress.ip_address(text)
                except ValueError:
                    continue
                if any(addr.version == n.version and addr in n for n in self.networks):
                    return True
        return False


def _link_local(text: str | None) -> bool:
    try:
        return text is not None and ipaddress.ip_address(text).is_link_local
    except ValueError:
        return False


def _under(host: str, suffix: str) -> bool:
    return host == suffix[1:] or host.endswith(suffix)


def parse_no_proxy(entries: object, key: str) -> NoProxy:
    """A list of entries (or one comma-separated string, as `NO_PROXY` is written)."""
    if isinstance(entries, str):
        items = [e.strip() for e in entries.split(",")]
    elif isinstance(entries, list | tuple) and all(isinstance(e, str) for e in entries):
        items = [str(e).strip() for e in entries]
    else:
        raise ValueError(f"{key}: expected a list of names, suffixes or CIDRs, got {entries!r}")
    everything = False
    names: set[str] = set()
    suffixes: list[str] = []
    networks: list[Network] = []
    ported: list[tuple[str, int]] = []
    for item in (i for i in items if i):
        if item == "*":
            everything = True
            continue
        try:
            networks.append(ipaddress.ip_network(item.strip("[]"), strict=False))
            continue
        except ValueError:
            pass
        host, port = item, None
        if item.count(":") == 1 and item.rsplit(":", 1)[1].isdigit():
            host, raw = item.rsplit(":", 1)
            port = int(raw)
        suffix = host.startswith((".", "*."))
        try:
            name = normalize_host(host.lstrip("*").lstrip("."))
        except DestinationError as exc:
            raise ValueError(f"{key}: {item!r} is not a name, suffix, address or CIDR "
                             f"({exc})") from None
        if port is not None:
            ported.append(("." + name if suffix else name, port))
        elif suffix:
            suffixes.append("." + name)
        else:
            names.add(name)
    return NoProxy(everything, frozenset(names), tuple(suffixes), tuple(networks),
                   tuple(ported), tuple(i for i in items if i))


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """One upstream proxy. `credentials`: the secret (in the gateway's secret store)
    holding `user:password`; `userinfo`: credentials read from the environment's URL
    (`network.upstream_proxy: env` only). `connect_to`: what the proxy is asked to
    connect to, the checked `address` (default) or the `name`."""

    scheme: str
    host: str
    port: int
    credentials: str | None = None
    no_proxy: NoProxy = field(default_factory=NoProxy)
    connect_to: str = "address"
    check_ready: bool = False
    userinfo: SecretValue | None = None
    source: str = "config"  # config | env

    @property
    def socks(self) -> bool:
        return self.scheme.startswith("socks5")

    @property
    def where(self) -> str:
        """The proxy as an operator reads it (no credentials)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def parse_proxy_url(url: str, key: str) -> tuple[str, str, int, str | None]:
    """`(scheme, host, port, "user:password" or None)` from a proxy URL."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{key}: not a proxy URL ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"{key}: the scheme must be http, https or socks5 "
                         f"(e.g. http://proxy.corp:3128), got {scheme or 'none'!r}")
    if not parts.hostname:
        raise ValueError(f"{key}: names no proxy host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{key}: a proxy URL is scheme://host:port only")
    try:
        host = normalize_host(parts.hostname)
    except DestinationError as exc:
        raise ValueError(f"{key}: {exc}") from None
    userinfo = None
    if parts.username is not None:
        userinfo = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
    return scheme, host, port or SCHEMES[scheme], userinfo


def parse_settings(raw: object, key: str) -> ProxySettings:
    """`network.upstream_proxy` as a map (`env` is read by `from_environment`)."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{key}: expected a map {{url: http://proxy.corp:3128, ...}} or env")
    unknown = sorted(str(k) for k in raw if k not in _KEYS)
    if unknown:
        raise ValueError(f"{key}.{unknown[0]}: unknown key (allowed: {', '.join(_KEYS)})")
    url = raw.get("url")
    if not isinstance(url, str) or not url:
        raise ValueError(f"{key}.url: required, e.g. http://proxy.corp:3128")
    scheme, host, port, userinfo = parse_proxy_url(url, f"{key}.url")
    if userinfo is not None:
        raise ValueError(f"{key}.url: carries credentials; put them in the secret store and "
                         f"name the secret in {key}.credentials")
    credentials = raw.get("credentials")
    if credentials is not None and (not isinstance(credentials, str) or not credentials):
        raise ValueError(f"{key}.credentials: expected a secret name, got {credentials!r}")
    connect_to = raw.get("connect_to", "address")
    if connect_to not in CONNECT_TO:
        raise ValueError(f"{key}.connect_to: expected address (the checked IP, the default) "
                         f"or name, got {connect_to!r}")
    check_ready = raw.get("check_ready", False)
    if not isinstance(check_ready, bool):
        raise ValueError(f"{key}.check_ready: expected true or false, got {check_ready!r}")
    return ProxySettings(scheme, host, port, credentials,
                         parse_no_proxy(raw.get("no_proxy", []), f"{key}.no_proxy"),
                         str(connect_to), check_ready)


def from_environment(env: Mapping[str, str], key: str) -> ProxySettings | None:
    """`network.upstream_proxy: env`: the first of HTTPS_PROXY, HTTP_PROXY, ALL_PROXY
    (either case) that is set, with NO_PROXY; None when none is set."""
    def get(name: str) -> str:
        return (env.get(name) or env.get(name.lower()) or "").strip()

    for name in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY"):
        url = get(name)
        if url:
            break
    else:
        return None
    if "://" not in url:
        url = "http://" + url  # (curl's reading of a bare host:port)
    scheme, host, port, userinfo = parse_proxy_url(url, f"{key} (from {name})")
    return ProxySettings(scheme, host, port,
                         no_proxy=parse_no_proxy(get("NO_PROXY"), f"{key} (from NO_PROXY)"),
                         userinfo=SecretValue(userinfo) if userinfo else None, source="env")
