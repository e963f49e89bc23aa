"""Warnings about a valid but risky configuration (`config check`, and logged at start).

A proxy listening on every interface with nothing said of what limits who reaches it
(`listen.reachable_from`); `network.upstream_proxy.connect_to: name`; `audit.spill.path`
on the file system of `audit.path` (the journal takes nothing when that disk fills); and
`network.allow_cidrs`. The destination check's precedence (gateway/core/addresses.py)
makes some of its entries do less than they seem to and others more than intended:

- a range over the hard-denied ranges (link-local incl. cloud metadata 169.254.0.0/16,
  multicast, reserved, ...) never opens them;
- a built-in special range strictly inside an allowed range stays denied (the more specific
  range wins): `0.0.0.0/0` and `::/0` open nothing at all;
- a whole private block (10/8, 172.16/12, 192.168/16, fc00::/7, CGNAT 100.64/10), anything
  wider than a /16 (IPv4) or /48 (IPv6), or loopback opens a lot to every sandbox whose
  policy names a host that resolves there.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from gateway.config import ALL_INTERFACES, Config, ConfigError

__all__ = ["allow_cidr_warnings", "audit_spill_warnings", "config_warnings", "listen_warnings",
           "upstream_proxy_warnings"]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

_HARD = {
    "169.254.0.0/16": "link-local, incl. cloud metadata 169.254.169.254",
    "0.0.0.0/8": "'this network'", "224.0.0.0/4": "multicast", "240.0.0.0/4": "reserved",
    "100.100.100.200/32": "cloud metadata", "fe80::/10": "link-local",
    "fd00:ec2::254/128": "cloud metadata", "ff00::/8": "multicast",
}
_BLOCKS = {
    "10.0.0.0/8": "private", "172.16.0.0/12": "private", "192.168.0.0/16": "private",
    "fc00::/7": "unique-local", "100.64.0.0/10": "carrier-grade NAT",
}
_SOFT = {**_BLOCKS, "127.0.0.0/8": "loopback", "::1/128": "loopback"}
_WIDE = {4: 16, 6: 48}  # prefix lengths shorter than these are "large"


def _nets(table: dict[str, str]) -> list[tuple[Network, str]]:
    return [(ipaddress.ip_network(cidr), label) for cidr, label in table.items()]


def allow_cidr_warnings(allow_cidrs: tuple[str, ...] | list[str]) -> list[str]:
    """One sentence per risky or ineffective `network.allow_cidrs` entry."""
    out: list[str] = []
    for text in allow_cidrs:
        try:
            net = ipaddress.ip_network(text, strict=False)
        except ValueError:
            raise ConfigError(f"network.allow_cidrs: {text!r} is not a CIDR "
                              "(e.g. 10.20.0.0/16)") from None
        key = f"network.allow_cidrs: {text}"
        if net.prefixlen == 0:
            example = "10.20.0.0/16" if net.version == 4 else "fd12:3456:789a::/48"
            out.append(f"{key} covers all of IPv{net.version} but opens nothing: every "
                       "private, loopback and special range inside it is more specific and "
                       "stays denied, and public addresses are allowed anyway; list the "
                       f"ranges the sandboxes must reach (e.g. {example})")
            continue
        for hard, label in _nets(_HARD):
            if hard.version != net.version or not net.overlaps(hard):
                continue
            if net.subnet_of(hard):  # type: ignore[arg-type]
                out.append(f"{key} opens nothing: it is inside {hard} ({label}), which is "
                           "hard-denied; no setting can open it")
            else:
                out.append(f"{key} overlaps {hard} ({label}), which stays denied: it is "
                           "hard-denied and no setting can open it")
        for soft, label in _nets(_SOFT):
            if soft.version != net.version or not net.overlaps(soft):
                continue
            if net != soft and soft.subnet_of(net):  # type: ignore[arg-type]
                out.append(f"{key} contains {soft} ({label}), which stays denied: a more "
                           f"specific built-in range wins; list {soft} itself to open it")
            elif label == "loopback":
                out.append(f"{key} opens loopback on the gateway host (its services, "
                           "except the gateway's own listeners) to the sandboxes")
            elif net == soft or net.prefixlen < _WIDE[net.version]:
                out.append(f"{key} opens a large {label} range (a /{net.prefixlen}) to "
                           "every sandbox whose policy names a host resolving there; narrow it "
                           "to the subnet the sandboxes need")
    return out


def upstream_proxy_warnings(cfg: Config) -> list[str]:
    """`network.upstream_proxy.connect_to: name` lets the proxy's own DNS choose the
    address the gateway checked: a name it resolves elsewhere (a private address, a
    rebinding answer) moves the connection past every destination check."""
    proxy = cfg.network.upstream_proxy
    if proxy is None or proxy.connect_to != "name":
        return []
    return ["network.upstream_proxy.connect_to: name: the proxy is asked for the name and "
            "resolves it itself, so the address the gateway checked is not the one "
            "connected to (a name the proxy resolves to a private address reaches it); "
            "use connect_to: address unless the proxy accepts only names"]


def _device(path: Path) -> int | None:
    """The file system `path` is on (that of its nearest existing parent), if known."""
    for where in (path, *path.parents):
        try:
            return os.stat(where).st_dev
        except OSError:
            continue
    return None


def audit_spill_warnings(cfg: Config) -> list[str]:
    """The spill journal holds audit lines while the audit file's disk is full: on that
    same disk it cannot take any either."""
    audit, spill = cfg.audit.path, cfg.audit.spill
    if audit is None or not spill.max or spill.path is None:
        return []
    device = _device(audit.parent)
    if device is None or device != _device(spill.path):
        return []
    return [f"audit.spill.path ({spill.path}) is on the file system of audit.path ({audit}): "
            "when that disk fills the spill journal takes no line either, and the lines "
            "past audit.buffer are dropped; put it on another volume"]


def learn_warnings(cfg: Config) -> list[str]:
    """`learn: true` (`run --learn`): every policy allows what no rule does."""
    if not cfg.learn:
        return []
    return ["learn is true: every policy is in mode: learn for this run, so the gateway "
            "allows (and records) what no rule allows; only the destination checks, leak "
            "markers and token checks refuse. Turn it off once `policy learn` has written "
            "the policy"]


def listen_warnings(cfg: Config) -> list[str]:
    """The proxy on every interface with no `listen.reachable_from`: any host that can
    route here can use it with a token and probe it without one, and nothing says what
    is meant to stop the others."""
    proxy = cfg.listen.proxy
    if proxy.host not in ALL_INTERFACES or cfg.listen.reachable_from.strip():
        return []
    return [f"listen.proxy {proxy} listens on every interface: any host that can reach this "
            "one can connect to the proxy (sandboxes need their token to use it; anyone can "
            "probe it), and the configuration does not say what limits that. Bind "
            f"127.0.0.1:{proxy.port} when the sandboxes are on this host, or restrict the "
            "port (a firewall, a Kubernetes NetworkPolicy) and say which in "
            "listen.reachable_from (the chart sets it with networkPolicy.enabled)"]


def config_warnings(cfg: Config) -> list[str]:
    """Every warning for `cfg` (empty when nothing looks risky)."""
    return (listen_warnings(cfg) + allow_cidr_warnings(cfg.network.allow_cidrs)
            + upstream_proxy_warnings(cfg) + audit_spill_warnings(cfg) + learn_warnings(cfg))
