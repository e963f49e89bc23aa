"""Gateway configuration: `gateway.yaml` plus `SANDBOX_GATEWAY_*` overrides, validated once.

Every key is optional. A wrong key or value stops the gateway with a message that
names it (`ConfigError("tokens.max_ttl: ...")`). Nested keys are overridden from the
environment with a double underscore: `SANDBOX_GATEWAY_LISTEN__PROXY=0.0.0.0:3128`.
Relative paths (given or defaulted) are relative to the config file's directory, or
to the working directory when there is no file. `SANDBOX_GATEWAY_SECRET_<NAME>`
belongs to the `env` secret store, not to the configuration, and is ignored here.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gateway.core import durations
from gateway.net.proxy_settings import ProxySettings, from_environment, parse_settings

ENV_PREFIX = "SANDBOX_GATEWAY_"
# SECRET_*: the env secret store. PORT*/SERVICE_*: Kubernetes service links of a
# Service named sandbox-gateway (SANDBOX_GATEWAY_PORT_8080_TCP, ..._SERVICE_HOST).
_ENV_IGNORED = ("SECRET_", "CONFIG", "PORT", "SERVICE_")


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names the key."""


@dataclass(frozen=True, slots=True)
class HostPort:
    """A listen address."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


ALL_INTERFACES = ("0.0.0.0", "::", "")


def reach(host: str, stated: str = "") -> str:
    """Who can connect to a listener bound to `host`, as the start banner says it (with
    `listen.reachable_from`, `stated`, for one on every interface)."""
    if host in ALL_INTERFACES:
        said = stated.strip()
        return ("reachable from other hosts: listening on every interface"
                + (f"; limited by: {said}" if said else ""))
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return "this host only: loopback"
    return f"reachable from other hosts on {host}'s network"


@dataclass(frozen=True, slots=True)
class ListenConfig:
    proxy: HostPort = HostPort("0.0.0.0", 8080)
    transparent: HostPort | None = None
    admin: HostPort = HostPort("127.0.0.1", 8090)
    dns: HostPort | None = None  # the policy-aware DNS resolver (gateway/engines/dns/), UDP and TCP
    # What limits who reaches a proxy listening on every interface (a firewall, a
    # Kubernetes NetworkPolicy), in words: stated, the banner shows it and `config check`
    # no longer warns. The gateway enforces nothing with it.
    reachable_from: str = ""


@dataclass(frozen=True, slots=True)
class TokensConfig:
    default_ttl: float = 15 * 60
    max_ttl: float = 24 * 3600
    max_lifetime: float = 7 * 24 * 3600
    leeway: float = 0.0
    issuer: str = "sandbox-gateway"
    signing_keys: Path | None = None  # default: <certs>/signing
    retired_kids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TimeoutsConfig:
    """`network.timeouts` (seconds): fit for inference, where long answers are normal."""

    connect: float = 10.0  # TCP connect to an upstream
    read: float = 300.0  # no byte from the upstream for this long: 504 upstream_timeout
    client_idle: float = 600.0  # a client connection or tunnel carrying nothing
    handshake: float = 30.0  # TLS handshakes, CONNECT and request heads once begun


@dataclass(frozen=True, slots=True)
class NetworkConfig:
    allow_cidrs: tuple[str, ...] = ()
    deny_cidrs: tuple[str, ...] = ()
    upstream_ca: Path | None = None
    resolve: Mapping[str, str] = field(default_factory=dict)
    upstream_idle_timeout: float = 30.0  # seconds; 0 keeps idle upstream connections open
    intercept: str = "fast"  # "fast": the gateway's own engines; "mitmproxy": mitmproxy only
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    # The corporate proxy every upstream dial goes through (None: dial direct); the
    # gateway's own HTTPS_PROXY is read only with `upstream_proxy: env`.
    upstream_proxy: ProxySettings | None = None


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    connections_per_sandbox: int = 256
    max_header_bytes: int = 64 * 1024
    max_websocket_message: int = 16 * 1024 * 1024
    max_tunnel_lifetime: float = 0.0  # seconds; 0 = no cap
    # Each worker's memory ceiling (runtime/memory.py): bytes, or a percentage of the
    # container's memory limit shared by the workers; 0 and 0.0: none.
    memory: int = 0
    memory_percent: float = 0.0


@dataclass(frozen=True, slots=True)
class RefusalsConfig:
    """How refusals reach clients (`refusals:`). `inside_tls`: a refused CONNECT is
    answered inside TLS with the gateway's leaf for the name (clients show an HTTP answer
    and its reason, where a CONNECT-level 403 reads as a connection error); False answers
    it at the CONNECT, as a proxy usually does."""

    inside_tls: bool = True


@dataclass(frozen=True, slots=True)
class ShutdownConfig:
    drain: float = 30.0  # SIGTERM: finish in-flight requests for at most this long


@dataclass(frozen=True, slots=True)
class DnsConfig:
    """The DNS resolver's answers and limits (`dns:`; it runs only with `listen.dns`)."""

    ttl: int = 10  # seconds on every answer: short, so policy changes and new addresses apply
    rate: float = 20.0  # queries per second per sandbox (token bucket refill)
    burst: int = 50  # bucket size: queries a sandbox may send at once


@dataclass(frozen=True, slots=True)
class MeteringConfig:
    """Inference metering: operator prices, how long hourly usage totals are kept, and
    whether OpenAI streaming requests get ``stream_options.include_usage`` added."""

    pricing: Path | None = None
    retention: float = 7 * 86400.0
    stream_usage: bool = True


@dataclass(frozen=True, slots=True)
class AuditSpillConfig:
    """`audit.spill`: the journal of audit lines the output did not take that did not fit
    in `audit.buffer` (and of those held at the stop), written first when it takes lines
    again or at the next start (gateway/observability/audit_spill.py)."""

    path: Path | None = None  # None: audit-spill/ next to the SQLite state file (below)
    max: int = 64 * 1024 * 1024  # bytes; 0: no journal (lines past the buffer dropped)


@dataclass(frozen=True, slots=True)
class AuditConfig:
    """Where audit lines go and what happens when they cannot be written (`audit:`)."""

    path: Path | None = None  # None: stdout
    on_failure: str = "refuse"  # refuse: 503 audit_unavailable; continue: serve, drop lines
    buffer: int = 4 * 1024 * 1024  # bytes of lines held while the target does not take them
    spill: AuditSpillConfig = field(default_factory=AuditSpillConfig)


@dataclass(frozen=True, slots=True)
class AdminTimeouts:
    """`admin.timeouts` (seconds): every wait of the admin listener."""

    head: float = 10.0  # from the connection (or a request's first byte) to its whole head
    body: float = 30.0  # from the head to the end of the body
    idle: float = 30.0  # a kept-alive connection with no request; a response not read


@dataclass(frozen=True, slots=True)
class AdminConfig:
    """The admin listener's bounds (`admin:`; its address is `listen.admin`)."""

    timeouts: AdminTimeouts = field(default_factory=AdminTimeouts)
    max_body: int = 2 * 1024 * 1024  # a larger request body: 413
    max_connections: int = 64  # more at once: 503 and closed


@dataclass(frozen=True, slots=True)
class ExchangeConfig:
    """`identity.kubernetes.exchange`: POST /v1/tokens/exchange takes a pod's projected
    service-account token (for `audience`), verified by `tokenreview` or `oidc`, and
    returns a gateway token bound to that pod for `ttl`."""

    enabled: bool = True
    audience: str = "sandbox-gateway"
    verify: str = "tokenreview"
    issuer: str | None = None  # oidc: the expected issuer (default: the discovery's)
    ttl: float = 3600.0


@dataclass(frozen=True, slots=True)
class KubernetesConfig:
    """`identity.kubernetes`: pods of the watched namespaces are sandboxes, known by
    their address (no token) or by an exchanged service-account token."""

    enabled: bool = False
    kubeconfig: Path | None = None  # None: the in-cluster service account
    namespaces: tuple[str, ...] = ()
    policy_label: str = "sandbox-gateway.io/policy"
    default_policies: Mapping[str, str] = field(default_factory=dict)
    pod_selector: str = ""
    stale_after: float = 30.0
    exchange: ExchangeConfig = field(default_factory=ExchangeConfig)


@dataclass(frozen=True, slots=True)
class Notifier:
    """Where ask mode tells people what is asked: a webhook (`format` slack: a
    Slack-compatible incoming webhook's `{"text": ...}`; json: the approval as JSON),
    each POST signed with HMAC-SHA256 by the value of `secret` (a name in the secret
    store) when one is named."""

    url: str
    format: str = "json"
    secret: str | None = None


@dataclass(frozen=True, slots=True)
class ApprovalsConfig:
    """Ask mode: the notifiers policies' `ask.notify` name, and how long answered
    approvals stay listed."""

    notify: Mapping[str, Notifier] = field(default_factory=dict)
    retention: float = 86400.0
    proposals: Path = Path("proposals")  # where `always` grants' policy changes are written


@dataclass(frozen=True, slots=True)
class ConsoleConfig:
    """The console (`/console` on the admin listener): how much of the newest audit lines
    its request log keeps — `retain` lines (which also bound its size at 1 KiB a line:
    `services/state/log.py`) or `retain_bytes` bytes; both 0: none, the log page is off —
    and the reverse proxies (addresses or networks) whose `X-Forwarded-Proto`/`-Host`/
    `-For` it believes."""

    retain: int = 100_000
    retain_bytes: int = 0
    trusted_proxies: tuple[str, ...] = ("127.0.0.1", "::1")


@dataclass(frozen=True, slots=True)
class IdentityConfig:
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)


@dataclass(frozen=True, slots=True)
class Config:
    """The whole validated configuration."""

    listen: ListenConfig = field(default_factory=ListenConfig)
    admin_token: str | None = None
    policies: Path = Path("policies")
    certs: Path = Path("certs")
    runtime_dir: Path | None = None
    tokens: TokensConfig = field(default_factory=TokensConfig)
    secrets: Mapping[str, Any] = field(
        default_factory=lambda: {"store": "file", "path": "secrets.local.yaml",
                                 "create_if_missing": True}
    )
    network: NetworkConfig = field(default_factory=NetworkConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    refusals: RefusalsConfig = field(default_factory=RefusalsConfig)
    shutdown: ShutdownConfig = field(default_factory=ShutdownConfig)
    dns: DnsConfig = field(default_factory=DnsConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    state: Mapping[str, Any] = field(default_factory=lambda: {"store": "sqlite"})
    metering: MeteringConfig = field(default_factory=MeteringConfig)
    identity: IdentityConfig = field(default_factory=IdentityConfig)
    approvals: ApprovalsConfig = field(default_factory=ApprovalsConfig)
    console: ConsoleConfig = field(default_factory=ConsoleConfig)
    workers: int = 0  # 0 = one worker process per core
    log_level: str = "info"
    source: str = "<defaults>"

    @property
    def signing_dir(self) -> Path:
        return self.tokens.signing_keys or self.certs / "signing"




def parse_duration(value: object, key: str = "duration") -> float:
    """Parse `15m`, `1h30m`, `90s`, `2d` or a number of seconds (ConfigError if not)."""
    try:
        return durations.parse_duration(value, key)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def parse_hostport(value: object, key: str) -> HostPort:
    """Parse `host:port`, `[v6]:port` or `:port` (all interfaces)."""
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected \"host:port\", got {value!r}")
    m = re.fullmatch(r"\[([0-9a-fA-F:.]+)\]:(\d+)|([^:\[\]]*):(\d+)", value.strip())
    if not m:
        raise ConfigError(f"{key}: expected \"host:port\" (e.g. 0.0.0.0:8080), got {value!r}")
    host = m.group(1) or m.group(3) or "0.0.0.0"
    port = int(m.group(2) or m.group(4))
    if not 0 <= port <= 65535:
        raise ConfigError(f"{key}: port must be between 0 and 65535, got {port}")
    return HostPort(host, port)


# --- schema ---------------------------------------------------------------------------

Parser = Callable[[object, str], Any]
Schema = Mapping[str, "Parser | Schema"]


def _str(value: object, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: expected a non-empty string, got {value!r}")
    return value


def _opt(parser: Parser) -> Parser:
    return lambda v, k: None if v is None else parser(v, k)


def _str_list(value: object, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise ConfigError(f"{key}: expected a list of strings, got {value!r}")
    return tuple(value)


def _str_map(value: object, key: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ConfigError(f"{key}: expected a map of strings, "
                          "e.g. {api.example: \"1.2.3.4:443\"}")
    return dict(value)


def _any_map(value: object, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a map, got {value!r}")
    return {str(k): v for k, v in value.items()}


def _int(value: object, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{key}: expected a non-negative integer, got {value!r}")
    return value


def _retain(value: object, key: str) -> tuple[int, int]:
    """`console.retain`: lines (`100000`) or bytes (`50MiB`): (lines, bytes), one 0."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, str):
        try:
            size = _size(value, key)
        except ConfigError:
            raise ConfigError(f"{key}: {value!r} is neither a number of lines (100000) nor "
                              "a size (50MiB)") from None
        if not 1024 * 1024 <= size <= 16 * 1024**3:
            raise ConfigError(f"{key}: a size between 1MiB and 16GiB, got {value!r}")
        return 0, size
    number = _int(value, key)
    if number > 10_000_000:
        raise ConfigError(f"{key}: at most 10000000 lines (up to 10 GB: 1 KiB a line)")
    return number, 0


def _networks(value: object, key: str) -> tuple[str, ...]:
    """A list of addresses or networks (`10.0.0.5`, `10.0.0.0/8`, `::1`)."""
    items = _str_list(value, key)
    for item in items:
        try:
            ipaddress.ip_network(item, strict=False)
        except ValueError:
            raise ConfigError(f"{key}: {item!r} is not an address or network "
                              "(e.g. 10.0.0.5 or 10.0.0.0/8)") from None
    return items


def _leeway(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ConfigError(f"{key}: expected seconds (a non-negative number), got {value!r}")
    return float(value)


def _idle(value: object, key: str) -> float:
    if value in (0, "0", "off"):
        return 0.0
    return parse_duration(value, key)


def _positive_int(value: object, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{key}: expected a positive integer, got {value!r}")
    return value


def _size(value: object, key: str) -> int:
    """A byte size: a number or `64k`, `16m`, `1g`."""
    if isinstance(value, str):
        m = re.fullmatch(r"(\d+)\s*([kmg]?)i?b?", value.strip().lower())
        if m is None:
            raise ConfigError(f"{key}: {value!r} is not a size; use e.g. 65536, 64k, 16m")
        return _positive_int(int(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2,
                                                 "g": 1024**3}[m.group(2)], key)
    return _positive_int(value, key)


def _memory(value: object, key: str) -> tuple[int, float]:
    """`limits.memory`: a size (`512MiB`: each worker's ceiling), a percentage (`85%`: of
    the container's memory limit, shared by the workers), or 0 / null for none."""
    if value is None or value == 0 or value == "0":
        return 0, 0.0
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            percent = float(value.strip()[:-1])
        except ValueError:
            percent = -1.0
        if not 1 <= percent <= 100:
            raise ConfigError(f"{key}: {value!r}: a percentage of the container's memory "
                              "limit between 1% and 100% (e.g. 85%), or a size (512MiB)")
        return 0, percent
    size = _size(value, key)
    if size < 64 * 1024 * 1024:
        raise ConfigError(f"{key}: at least 64MiB (a worker idles at about 70 MiB), or a "
                          f"percentage such as 85%, got {value!r}")
    return size, 0.0


def _intercept(value: object, key: str) -> str:
    if value not in ("fast", "mitmproxy"):
        raise ConfigError(f"{key}: expected fast or mitmproxy, got {value!r}")
    return str(value)


def _dns_ttl(value: object, key: str) -> int:
    seconds = parse_duration(value, key)
    if not 1 <= seconds <= 3600:
        raise ConfigError(f"{key}: expected between 1s and 1h (short: answers outlive policy "
                          f"changes by this much), got {value!r}")
    return round(seconds)


def _rate(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{key}: expected queries per second (a positive number), "
                          f"got {value!r}")
    return float(value)


def _burst(value: object, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}: expected a positive integer, got {value!r}")
    return value


def _bool(value: object, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    return value


def _on_failure(value: object, key: str) -> str:
    if value not in ("refuse", "continue"):
        raise ConfigError(f"{key}: expected refuse (503 audit_unavailable while audit lines "
                          f"cannot be written) or continue, got {value!r}")
    return str(value)


def _audit_buffer(value: object, key: str) -> int:
    size = _size(value, key)
    if size < 64 * 1024:
        raise ConfigError(f"{key}: at least 64k (audit lines held while they cannot be "
                          f"written), got {value!r}")
    return size


def _spill_max(value: object, key: str) -> int:
    if value == 0 or value == "0":
        return 0
    size = _size(value, key)
    if size < 64 * 1024:
        raise ConfigError(f"{key}: 0 (no spill journal) or at least 64k, got {value!r}")
    return size


def _verify(value: object, key: str) -> str:
    if value not in ("tokenreview", "oidc"):
        raise ConfigError(f"{key}: expected tokenreview (ask the API server) or oidc "
                          f"(verify offline against the cluster's JWKS), got {value!r}")
    return str(value)


def _string(value: object, key: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


def _notifiers(value: object, key: str) -> dict[str, Notifier]:
    """`approvals.notify`: {name: {url, format: json | slack, secret: <secret name>}}."""
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a map of notifiers, e.g. {{ops: {{url: "
                          "https://hooks.example/T/B, format: slack, secret: hook-key}}")
    out: dict[str, Notifier] = {}
    for name, spec in value.items():
        where = f"{key}.{name}"
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}",
                                                         name):
            raise ConfigError(f"{key}: {name!r} is not a notifier name (letters, digits, "
                              "'.', '_', '-')")
        if not isinstance(spec, dict) or set(spec) - {"url", "format", "secret"}:
            raise ConfigError(f"{where}: expected {{url, format, secret}}, got {spec!r}")
        url = _str(spec.get("url"), f"{where}.url")
        if not re.match(r"https?://[^/\s]+", url):
            raise ConfigError(f"{where}.url: expected an http(s) URL, got {url!r}")
        kind = spec.get("format", "json")
        if kind not in ("json", "slack"):
            raise ConfigError(f"{where}.format: expected json or slack, got {kind!r}")
        secret = spec.get("secret")
        out[name] = Notifier(url=url, format=kind,
                             secret=None if secret is None else _str(secret, f"{where}.secret"))
    return out


def _upstream_proxy(value: object, key: str) -> ProxySettings | str | None:
    """`network.upstream_proxy`: a map (`gateway/net/proxy_settings.py`), `env` (read
    from the gateway's environment by `load_config`), or null."""
    if value is None or value == "env":
        return value
    try:
        return parse_settings(value, key)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _level(value: object, key: str) -> str:
    levels = ("debug", "info", "warning", "error")
    if value not in levels:
        raise ConfigError(f"{key}: expected one of {', '.join(levels)}, got {value!r}")
    return str(value)


SCHEMA: Schema = {
    "listen": {
        "proxy": parse_hostport,
        "transparent": _opt(parse_hostport),
        "admin": parse_hostport,
        "dns": _opt(parse_hostport),
        "reachable_from": _str,
    },
    "admin_token": _opt(_str),
    "policies": _str,
    "certs": _str,
    "runtime_dir": _opt(_str),
    "tokens": {
        "default_ttl": parse_duration,
        "max_ttl": parse_duration,
        "max_lifetime": parse_duration,
        "leeway": _leeway,
        "issuer": _str,
        "signing_keys": _opt(_str),
        "retired_kids": _str_list,
    },
    "secrets": _any_map,
    "network": {
        "allow_cidrs": _str_list,
        "deny_cidrs": _str_list,
        "upstream_ca": _opt(_str),
        "resolve": _str_map,
        "upstream_idle_timeout": _idle,
        "intercept": _intercept,
        "upstream_proxy": _upstream_proxy,
        "timeouts": {
            "connect": parse_duration,
            "read": parse_duration,
            "client_idle": parse_duration,
            "handshake": parse_duration,
        },
    },
    "limits": {
        "connections_per_sandbox": _positive_int,
        "max_header_bytes": _size,
        "max_websocket_message": _size,
        "max_tunnel_lifetime": _idle,
        "memory": _memory,
    },
    "refusals": {"inside_tls": _bool},
    "shutdown": {"drain": _idle},
    "dns": {"ttl": _dns_ttl, "rate": _rate, "burst": _burst},
    "audit": {"path": _opt(_str), "on_failure": _on_failure, "buffer": _audit_buffer,
              "spill": {"path": _opt(_str), "max": _spill_max}},
    "admin": {
        "timeouts": {"head": parse_duration, "body": parse_duration, "idle": parse_duration},
        "max_body": _size,
        "max_connections": _positive_int,
    },
    "state": _any_map,
    "metering": {
        "pricing": _opt(_str),
        "retention": parse_duration,
        "stream_usage": _bool,
    },
    "identity": {
        "kubernetes": {
            "enabled": _bool,
            "kubeconfig": _opt(_str),
            "namespaces": _str_list,
            "policy_label": _str,
            "default_policies": _str_map,
            "pod_selector": _string,
            "stale_after": parse_duration,
            "exchange": {
                "enabled": _bool,
                "audience": _str,
                "verify": _verify,
                "issuer": _opt(_str),
                "ttl": parse_duration,
            },
        },
    },
    "approvals": {"notify": _notifiers, "retention": parse_duration, "proposals": _str},
    "console": {"retain": _retain, "trusted_proxies": _networks},
    "workers": _int,
    "log_level": _level,
}

_ENV_TYPED = {"workers", "tokens.leeway", "limits.connections_per_sandbox",
              "network.allow_cidrs", "network.deny_cidrs", "network.resolve",
              "tokens.retired_kids", "secrets", "state", "dns.rate", "dns.burst",
              "metering.stream_usage", "admin.max_connections", "refusals.inside_tls",
              "identity.kubernetes.enabled", "identity.kubernetes.namespaces",
              "identity.kubernetes.default_policies", "identity.kubernetes.exchange.enabled",
              "network.upstream_proxy.check_ready", "console.retain",
              "console.trusted_proxies"}


def _validate(raw: Mapping[str, Any], schema: Schema, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if key not in schema:
            hint = difflib.get_close_matches(str(key), list(schema), n=1)
            suggestion = f"; did you mean {prefix}{hint[0]}?" if hint else ""
            raise ConfigError(f"{name}: unknown key{suggestion}")
        spec = schema[key]
        if isinstance(spec, Mapping):
            if value is None:
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(f"{name}: expected a map, got {value!r}")
            out[key] = _validate(value, spec, f"{name}.")
        else:
            out[key] = spec(value, name)
    return out


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for var, text in env.items():
        if not var.startswith(ENV_PREFIX):
            continue
        rest = var[len(ENV_PREFIX):]
        if rest.startswith(_ENV_IGNORED) or not rest:
            continue
        path = [p.lower() for p in rest.split("__")]
        dotted = ".".join(path)
        value: Any = text
        if dotted in _ENV_TYPED or dotted.startswith(("secrets.", "state.")):
            try:
                value = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise ConfigError(f"{var}: not valid YAML: {exc}") from None
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{var}: conflicts with another override")
        node[path[-1]] = value
    return tree


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def load_config(path: Path | str | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Load `path` (optional), apply environment overrides, validate, build a Config."""
    env = os.environ if env is None else env
    if path is None and env.get(ENV_PREFIX + "CONFIG"):
        path = env[ENV_PREFIX + "CONFIG"]
    raw: dict[str, Any] = {}
    base = Path.cwd()
    source = "<defaults>"
    if path is not None:
        file = Path(path)
        try:
            loaded = yaml.safe_load(file.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"{file}: cannot read: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{file}: cannot read: not UTF-8 text") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{file}: not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{file}: expected a map of settings at the top level")
        raw = loaded or {}
        base = file.resolve().parent
        source = str(file)
    merged = _merge(raw, _env_overrides(env))
    try:
        values = _validate(merged, SCHEMA)
        network = values.get("network", {})
        if network.get("upstream_proxy") == "env":
            network["upstream_proxy"] = from_environment(env, "network.upstream_proxy: env")
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return _build(values, base, source)


def _path(base: Path, value: str | None) -> Path | None:
    if value is None:
        return None
    p = Path(value).expanduser()
    return p if p.is_absolute() else base / p


def _state(state: Mapping[str, Any], base: Path) -> Mapping[str, Any]:
    """The `state` section with the SQLite file's path made absolute (relative to the
    config's directory, default `state/gateway.db`)."""
    out = dict(state)
    if out.get("store", "sqlite") == "sqlite":
        raw = out.get("path", "state/gateway.db")
        out["path"] = str(_path(base, raw if isinstance(raw, str) else str(raw)))
    return out


def _build(v: dict[str, Any], base: Path, source: str) -> Config:
    d = Config()
    listen = v.get("listen", {})
    tokens = v.get("tokens", {})
    network = v.get("network", {})
    dns = v.get("dns", {})
    metering = v.get("metering", {})
    cfg_tokens = TokensConfig(
        default_ttl=tokens.get("default_ttl", d.tokens.default_ttl),
        max_ttl=tokens.get("max_ttl", d.tokens.max_ttl),
        max_lifetime=tokens.get("max_lifetime", d.tokens.max_lifetime),
        leeway=tokens.get("leeway", d.tokens.leeway),
        issuer=tokens.get("issuer", d.tokens.issuer),
        signing_keys=_path(base, tokens.get("signing_keys")),
        retired_kids=tokens.get("retired_kids", ()),
    )
    audit_cfg = v.get("audit", {})
    spill_max = audit_cfg.get("spill", {}).get("max", AuditSpillConfig().max)
    if spill_max and spill_max < audit_cfg.get("buffer", d.audit.buffer):
        raise ConfigError(f"{source}: audit.spill.max is smaller than audit.buffer (the "
                          "journal takes the buffer's lines at the stop): raise it, or 0 "
                          "for no journal")
    if cfg_tokens.default_ttl > cfg_tokens.max_ttl:
        raise ConfigError(f"{source}: tokens.default_ttl is longer than tokens.max_ttl")
    secrets = dict(v.get("secrets", d.secrets))
    if isinstance(secrets.get("path"), str):
        secrets["path"] = str(_path(base, secrets["path"]))
    upstream_ca = _path(base, network.get("upstream_ca"))
    timeouts = network.get("timeouts", {})
    limits = v.get("limits", {})
    d_limits = d.limits
    memory: tuple[int, float] = limits.get("memory", (0, 0.0))
    audit = v.get("audit", {})
    admin = v.get("admin", {})
    admin_timeouts = admin.get("timeouts", {})
    return Config(
        listen=ListenConfig(
            proxy=listen.get("proxy", d.listen.proxy),
            transparent=listen.get("transparent"),
            admin=listen.get("admin", d.listen.admin),
            dns=listen.get("dns"),
            reachable_from=listen.get("reachable_from", ""),
        ),
        admin_token=v.get("admin_token"),
        policies=_path(base, v.get("policies", "policies")) or d.policies,
        certs=_path(base, v.get("certs", "certs")) or d.certs,
        runtime_dir=_path(base, v.get("runtime_dir")),
        tokens=cfg_tokens,
        secrets=secrets,
        network=NetworkConfig(
            allow_cidrs=network.get("allow_cidrs", ()),
            deny_cidrs=network.get("deny_cidrs", ()),
            upstream_ca=upstream_ca,
            resolve=network.get("resolve", {}),
            upstream_idle_timeout=network.get("upstream_idle_timeout",
                                              d.network.upstream_idle_timeout),
            intercept=network.get("intercept", d.network.intercept),
            upstream_proxy=network.get("upstream_proxy"),
            timeouts=TimeoutsConfig(**{k: timeouts.get(k, getattr(d.network.timeouts, k))
                                       for k in ("connect", "read", "client_idle",
                                                 "handshake")}),
        ),
        limits=LimitsConfig(**{k: limits.get(k, getattr(d_limits, k)) for k in (
            "connections_per_sandbox", "max_header_bytes", "max_websocket_message",
            "max_tunnel_lifetime")}, memory=memory[0], memory_percent=memory[1]),
        refusals=RefusalsConfig(inside_tls=v.get("refusals", {}).get(
            "inside_tls", d.refusals.inside_tls)),
        shutdown=ShutdownConfig(drain=v.get("shutdown", {}).get("drain", d.shutdown.drain)),
        dns=DnsConfig(ttl=dns.get("ttl", d.dns.ttl), rate=dns.get("rate", d.dns.rate),
                      burst=dns.get("burst", d.dns.burst)),
        audit=AuditConfig(path=_path(base, audit.get("path")),
                          on_failure=audit.get("on_failure", d.audit.on_failure),
                          buffer=audit.get("buffer", d.audit.buffer),
                          spill=_audit_spill(audit.get("spill", {}), v, base)),
        admin=AdminConfig(
            timeouts=AdminTimeouts(**{k: admin_timeouts.get(k, getattr(d.admin.timeouts, k))
                                      for k in ("head", "body", "idle")}),
            max_body=admin.get("max_body", d.admin.max_body),
            max_connections=admin.get("max_connections", d.admin.max_connections)),
        state=_state(v.get("state", d.state), base),
        metering=MeteringConfig(
            pricing=_path(base, metering.get("pricing")),
            retention=metering.get("retention", d.metering.retention),
            stream_usage=metering.get("stream_usage", d.metering.stream_usage),
        ),
        identity=IdentityConfig(kubernetes=_kubernetes(
            v.get("identity", {}).get("kubernetes", {}), base, source)),
        approvals=ApprovalsConfig(
            notify=v.get("approvals", {}).get("notify", {}),
            retention=v.get("approvals", {}).get("retention", d.approvals.retention),
            proposals=_path(base, v.get("approvals", {}).get("proposals", "proposals"))
            or d.approvals.proposals),
        console=ConsoleConfig(
            retain=v.get("console", {}).get("retain", (d.console.retain, 0))[0],
            retain_bytes=v.get("console", {}).get("retain", (0, d.console.retain_bytes))[1],
            trusted_proxies=v.get("console", {}).get("trusted_proxies",
                                                     d.console.trusted_proxies)),
        workers=v.get("workers", d.workers),
        log_level=v.get("log_level", d.log_level),
        source=source,
    )


def _audit_spill(spill: dict[str, Any], v: dict[str, Any], base: Path) -> AuditSpillConfig:
    """`audit.spill`, its path made absolute: by default `audit-spill/` in the SQLite
    state file's directory (a volume kept across restarts, apart from the audit file's),
    else in `runtime_dir`, else `state/audit-spill` next to the config."""
    path = _path(base, spill.get("path"))
    if path is None:
        state = _state(v.get("state", Config().state), base)
        if state.get("store", "sqlite") == "sqlite":
            path = Path(str(state["path"])).parent / "audit-spill"
        else:
            path = (_path(base, v.get("runtime_dir")) or base / "state") / "audit-spill"
    return AuditSpillConfig(path=path, max=spill.get("max", AuditSpillConfig().max))


def _kubernetes(k: dict[str, Any], base: Path, source: str) -> KubernetesConfig:
    d = KubernetesConfig()
    x = k.get("exchange", {})
    cfg = KubernetesConfig(
        enabled=k.get("enabled", d.enabled),
        kubeconfig=_path(base, k.get("kubeconfig")),
        namespaces=k.get("namespaces", d.namespaces),
        policy_label=k.get("policy_label", d.policy_label),
        default_policies=k.get("default_policies", {}),
        pod_selector=k.get("pod_selector", d.pod_selector),
        stale_after=k.get("stale_after", d.stale_after),
        exchange=ExchangeConfig(**{key: x.get(key, getattr(d.exchange, key)) for key in (
            "enabled", "audience", "verify", "issuer", "ttl")}),
    )
    if cfg.enabled and not cfg.namespaces:
        raise ConfigError(f"{source}: identity.kubernetes.namespaces: list the sandbox "
                          "namespaces whose pods are watched (e.g. [sandboxes])")
    unwatched = sorted(set(cfg.default_policies) - set(cfg.namespaces))
    if cfg.enabled and unwatched:
        raise ConfigError(f"{source}: identity.kubernetes.default_policies: namespace "
                          f"{unwatched[0]!r} is not in identity.kubernetes.namespaces")
    return cfg
