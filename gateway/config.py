"""Gateway configuration: `gateway.yaml` plus `SANDBOX_GATEWAY_*` overrides, validated once.

Every key is optional. A wrong key or value stops the gateway with a message that
names it (`ConfigError("tokens.max_ttl: ...")`). Nested keys are overridden from the
environment with a double underscore: `SANDBOX_GATEWAY_LISTEN__PROXY=0.0.0.0:3128`.
Relative paths (given or defaulted) are relative to the config file's directory, or
to the working directory when there is no file. `SANDBOX_GATEWAY_SECRET_<NAME>`
belongs to the `env` secret store, not to the configuration, and is ignored here.

The schema is the classes below (issue 41, item 6): msgspec `Struct`s whose fields are
the keys, with their types and embedded defaults; a key's field is annotated with the
`Value` that reads what people write (`15m`, `64k`, `85%`, `host:port`) with a message
naming the key (gateway/config_values.py). `_read` walks a YAML tree along the classes
(unknown keys with "did you mean", sections that are not maps, each value's reader);
msgspec builds and type-checks the result. msgspec over pydantic: a tenth of the import
time and of the memory (docs/configuration.md, "The schema").
"""

from __future__ import annotations

import difflib
import ipaddress
import os
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

import msgspec
import yaml

from gateway.config_values import (
    ANY_MAP,
    AUDIT_BUFFER,
    BOOL,
    BURST,
    COUNT,
    DNS_TTL,
    DURATION,
    ENDPOINT,
    HOST_PATTERNS,
    HOSTPORT,
    IDLE,
    INTERCEPT,
    LEEWAY,
    LEVEL,
    MEMORY,
    NETWORKS,
    NOTIFIERS,
    OAUTH_CLIENTS,
    ON_FAILURE,
    OTLP_PROTOCOL,
    PATH,
    POSITIVE,
    RATE,
    RATIO,
    RETAIN,
    SIZE,
    SPILL_MAX,
    STR_LIST,
    STR_MAP,
    STRING,
    TEXT,
    UPSTREAM_PROXY,
    VERIFY,
    HostPort,
    Notifier,
    OAuthClient,
    Value,
    optional,
    parse_hostport,
)
from gateway.core.durations import parse_duration
from gateway.errors import ConfigError
from gateway.net.proxy_settings import ProxySettings, from_environment

__all__ = ["ENV_PREFIX", "SCHEMA", "AdminConfig", "AdminTimeouts", "ApprovalsConfig",
           "AuditConfig", "AuditSpillConfig", "Config", "ConfigError", "ConsoleConfig",
           "DnsConfig", "ExchangeConfig", "HostPort", "IdentityConfig", "KubernetesConfig",
           "LimitsConfig", "ListenConfig", "McpOAuthConfig", "MeteringConfig",
           "NetworkConfig", "Notifier", "OAuthClient",
           "RefusalsConfig", "ShutdownConfig", "TelemetryConfig", "TimeoutsConfig",
           "TokensConfig", "keys", "load_config", "parse_duration", "parse_hostport"]

ENV_PREFIX = "SANDBOX_GATEWAY_"
# SECRET_*: the env secret store. PORT*/SERVICE_*: Kubernetes service links of a
# Service named sandbox-gateway (SANDBOX_GATEWAY_PORT_8080_TCP, ..._SERVICE_HOST).
_ENV_IGNORED = ("SECRET_", "CONFIG", "PORT", "SERVICE_")
# Overrides of keys inside a map value, read as YAML like `Value.env_yaml` keys.
_ENV_YAML_BELOW = ("secrets.", "state.", "network.upstream_proxy.check_ready")


class Section(msgspec.Struct, frozen=True, kw_only=True):
    """A map of keys in `gateway.yaml`: its fields annotated with a `Value` or typed as a
    `Section` are keys; other fields are derived (filled by a `Value.into`, or not read)."""


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


class ListenConfig(Section, frozen=True, kw_only=True):
    proxy: Annotated[HostPort, HOSTPORT] = HostPort("0.0.0.0", 8080)
    transparent: Annotated[HostPort | None, optional(HOSTPORT)] = None
    admin: Annotated[HostPort, HOSTPORT] = HostPort("127.0.0.1", 8090)
    # the policy-aware DNS resolver (gateway/engines/dns/), UDP and TCP
    dns: Annotated[HostPort | None, optional(HOSTPORT)] = None
    # What limits who reaches a proxy listening on every interface (a firewall, a
    # Kubernetes NetworkPolicy), in words: stated, the banner shows it and `config check`
    # no longer warns. The gateway enforces nothing with it.
    reachable_from: Annotated[str, STRING] = ""


class TokensConfig(Section, frozen=True, kw_only=True):
    default_ttl: Annotated[float, DURATION] = 15 * 60.0
    max_ttl: Annotated[float, DURATION] = 24 * 3600.0
    max_lifetime: Annotated[float, DURATION] = 7 * 24 * 3600.0
    leeway: Annotated[float, LEEWAY] = 0.0
    issuer: Annotated[str, TEXT] = "sandbox-gateway"
    signing_keys: Annotated[Path | None, optional(PATH)] = None  # default: <certs>/signing
    retired_kids: Annotated[tuple[str, ...], STR_LIST] = ()


class TimeoutsConfig(Section, frozen=True, kw_only=True):
    """`network.timeouts` (seconds): fit for inference, where long answers are normal."""

    connect: Annotated[float, DURATION] = 10.0  # TCP connect to an upstream
    read: Annotated[float, DURATION] = 300.0  # no byte from the upstream: 504 upstream_timeout
    client_idle: Annotated[float, DURATION] = 600.0  # a client connection carrying nothing
    handshake: Annotated[float, DURATION] = 30.0  # TLS handshakes, CONNECT and heads once begun


class NetworkConfig(Section, frozen=True, kw_only=True):
    allow_cidrs: Annotated[tuple[str, ...], STR_LIST] = ()
    deny_cidrs: Annotated[tuple[str, ...], STR_LIST] = ()
    upstream_ca: Annotated[Path | None, optional(PATH)] = None
    resolve: Annotated[Mapping[str, str], STR_MAP] = msgspec.field(default_factory=dict)
    # seconds; 0 keeps idle upstream connections open
    upstream_idle_timeout: Annotated[float, IDLE] = 30.0
    # "fast": the gateway's own engines; "mitmproxy": mitmproxy only
    intercept: Annotated[str, INTERCEPT] = "fast"
    # The corporate proxy every upstream dial goes through (None: dial direct); the
    # gateway's own HTTPS_PROXY is read only with `upstream_proxy: env`.
    upstream_proxy: Annotated[ProxySettings | None, UPSTREAM_PROXY] = None
    timeouts: TimeoutsConfig = TimeoutsConfig()


class LimitsConfig(Section, frozen=True, kw_only=True):
    connections_per_sandbox: Annotated[int, POSITIVE] = 256
    max_header_bytes: Annotated[int, SIZE] = 64 * 1024
    max_websocket_message: Annotated[int, SIZE] = 16 * 1024 * 1024
    max_tunnel_lifetime: Annotated[float, IDLE] = 0.0  # seconds; 0 = no cap
    # what a sandbox's compressed data may unpack to past 16 times its size, across its
    # requests (a bucket of bytes, refilled at the rate a second; the gateway's, split
    # equally between its workers): pipeline/unpacking.py
    unpacked_excess: Annotated[int, SIZE] = 256 * 1024 * 1024
    unpacked_excess_rate: Annotated[int, SIZE] = 16 * 1024 * 1024
    # Each worker's memory ceiling (runtime/memory.py): bytes, or a percentage of the
    # container's memory limit shared by the workers; 0 and 0.0: none.
    memory: Annotated[int, MEMORY] = 0
    memory_percent: float = 0.0  # (from `memory: 85%`)


class RefusalsConfig(Section, frozen=True, kw_only=True):
    """How refusals reach clients (`refusals:`). `inside_tls`: a refused CONNECT is
    answered inside TLS with the gateway's leaf for the name (clients show an HTTP answer
    and its reason, where a CONNECT-level 403 reads as a connection error); False answers
    it at the CONNECT, as a proxy usually does."""

    inside_tls: Annotated[bool, BOOL] = True


class ShutdownConfig(Section, frozen=True, kw_only=True):
    drain: Annotated[float, IDLE] = 30.0  # SIGTERM: finish in-flight requests this long at most


class DnsConfig(Section, frozen=True, kw_only=True):
    """The DNS resolver's answers and limits (`dns:`; it runs only with `listen.dns`)."""

    # seconds on every answer: short, so policy changes and new addresses apply
    ttl: Annotated[int, DNS_TTL] = 10
    rate: Annotated[float, RATE] = 20.0  # queries per second per sandbox (bucket refill)
    burst: Annotated[int, BURST] = 50  # bucket size: queries a sandbox may send at once


class MeteringConfig(Section, frozen=True, kw_only=True):
    """Inference metering: operator prices, how long hourly usage totals are kept, and
    whether OpenAI streaming requests get ``stream_options.include_usage`` added."""

    pricing: Annotated[Path | None, optional(PATH)] = None
    retention: Annotated[float, DURATION] = 7 * 86400.0
    stream_usage: Annotated[bool, BOOL] = True


class AuditSpillConfig(Section, frozen=True, kw_only=True):
    """`audit.spill`: the journal of audit lines the output did not take that did not fit
    in `audit.buffer` (and of those held at the stop), written first when it takes lines
    again or at the next start (gateway/observability/audit_spill.py)."""

    # None: audit-spill/ next to the SQLite state file (`_spill_path`)
    path: Annotated[Path | None, optional(PATH)] = None
    # bytes; 0: no journal (lines past the buffer dropped)
    max: Annotated[int, SPILL_MAX] = 64 * 1024 * 1024


class AuditConfig(Section, frozen=True, kw_only=True):
    """Where audit lines go and what happens when they cannot be written (`audit:`)."""

    path: Annotated[Path | None, optional(PATH)] = None  # None: stdout
    # refuse: 503 audit_unavailable; continue: serve, drop lines
    on_failure: Annotated[str, ON_FAILURE] = "refuse"
    # bytes of lines held while the target does not take them
    buffer: Annotated[int, AUDIT_BUFFER] = 4 * 1024 * 1024
    spill: AuditSpillConfig = AuditSpillConfig()
    # each line also as an OTLP log record to `telemetry.endpoint`
    otlp: Annotated[bool, BOOL] = False


class TelemetryConfig(Section, frozen=True, kw_only=True):
    """OpenTelemetry export (`telemetry:`; gateway/observability/otel*.py): a span per
    audit line (GenAI and MCP conventions), GenAI metrics, and with `audit.otlp` the audit
    lines as log records, to the collector at `endpoint` over OTLP, from an exporter
    process per worker. No endpoint: off, no exporter process, the OpenTelemetry SDK not
    imported."""

    endpoint: Annotated[str | None, optional(ENDPOINT)] = None
    protocol: Annotated[str, OTLP_PROTOCOL] = "grpc"
    # sent with every export (e.g. the collector's auth); never logged
    headers: Annotated[Mapping[str, str], STR_MAP] = msgspec.field(default_factory=dict)
    traces: Annotated[bool, BOOL] = True
    metrics: Annotated[bool, BOOL] = True
    # spans of plain allowed requests exported (refusals, inference, MCP calls and
    # requests in a sampled sandbox trace: always)
    sample: Annotated[float, RATIO] = 1.0
    service_name: Annotated[str, TEXT] = "sandbox-gateway"
    # audit lines a worker holds while its exporter process takes none; more are dropped
    # and counted (the exporter's SDK queues as many spans and log records)
    queue: Annotated[int, POSITIVE] = 8192
    metrics_interval: Annotated[float, DURATION] = 60.0  # between metric exports
    # hosts whose requests carry the gateway's span as their `traceparent` (added, or the
    # sandbox's continued); every other request leaves with the trace headers it came with
    propagate: Annotated[tuple[str, ...], HOST_PATTERNS] = ()


class AdminTimeouts(Section, frozen=True, kw_only=True):
    """`admin.timeouts` (seconds): every wait of the admin listener."""

    head: Annotated[float, DURATION] = 10.0  # from the connection (or a request) to its head
    body: Annotated[float, DURATION] = 30.0  # from the head to the end of the body
    idle: Annotated[float, DURATION] = 30.0  # a kept-alive connection with no request


class AdminConfig(Section, frozen=True, kw_only=True):
    """The admin listener's bounds (`admin:`; its address is `listen.admin`)."""

    timeouts: AdminTimeouts = AdminTimeouts()
    max_body: Annotated[int, SIZE] = 2 * 1024 * 1024  # a larger request body: 413
    max_connections: Annotated[int, POSITIVE] = 64  # more at once: 503 and closed


class ExchangeConfig(Section, frozen=True, kw_only=True):
    """`identity.kubernetes.exchange`: POST /v1/tokens/exchange takes a pod's projected
    service-account token (for `audience`), verified by `tokenreview` or `oidc`, and
    returns a gateway token bound to that pod for `ttl`."""

    enabled: Annotated[bool, BOOL] = True
    audience: Annotated[str, TEXT] = "sandbox-gateway"
    verify: Annotated[str, VERIFY] = "tokenreview"
    # oidc: the expected issuer (default: the discovery's)
    issuer: Annotated[str | None, optional(TEXT)] = None
    ttl: Annotated[float, DURATION] = 3600.0


class KubernetesConfig(Section, frozen=True, kw_only=True):
    """`identity.kubernetes`: pods of the watched namespaces are sandboxes, known by
    their address (no token) or by an exchanged service-account token."""

    enabled: Annotated[bool, BOOL] = False
    # None: the in-cluster service account
    kubeconfig: Annotated[Path | None, optional(PATH)] = None
    namespaces: Annotated[tuple[str, ...], STR_LIST] = ()
    policy_label: Annotated[str, TEXT] = "sandbox-gateway.io/policy"
    default_policies: Annotated[Mapping[str, str], STR_MAP] = msgspec.field(
        default_factory=dict)
    pod_selector: Annotated[str, STRING] = ""
    stale_after: Annotated[float, DURATION] = 30.0
    exchange: ExchangeConfig = ExchangeConfig()


class ApprovalsConfig(Section, frozen=True, kw_only=True):
    """Ask mode: the notifiers policies' `ask.notify` name, and how long answered
    approvals stay listed."""

    notify: Annotated[Mapping[str, Notifier], NOTIFIERS] = msgspec.field(default_factory=dict)
    retention: Annotated[float, DURATION] = 86400.0
    # where `always` grants' policy changes are written
    proposals: Annotated[Path, PATH] = Path("proposals")


class McpOAuthConfig(Section, frozen=True, kw_only=True):
    """The gateway as MCP servers' OAuth client (policies' `mcp.oauth`, docs/mcp-oauth.md):
    the clients policies name, the key that seals the tokens in the state store (a
    secret store name, or a file created on first start), the callback URL people's
    browsers are sent back to (default: the admin listener's `/v1/mcp/oauth/callback`),
    and the URL of the gateway's client ID metadata document where it is published
    (used as its client ID by authorization servers that support one)."""

    clients: Annotated[Mapping[str, OAuthClient], OAUTH_CLIENTS] = msgspec.field(
        default_factory=dict)
    key_file: Annotated[Path | None, optional(PATH)] = None  # default: <certs>/mcp-oauth-key
    key_secret: Annotated[str | None, optional(TEXT)] = None  # the key in the secret store
    redirect_url: Annotated[str | None, optional(TEXT)] = None
    client_metadata_url: Annotated[str | None, optional(TEXT)] = None


class DlpConfig(Section, frozen=True, kw_only=True):
    """Outbound credential detection (policies' `dlp:`): the file holding the salt of
    the fingerprints audit lines carry (created on first start; see docs/dlp.md)."""

    salt_file: Annotated[Path | None, optional(PATH)] = None  # default: <certs>/dlp-salt


class ConsoleConfig(Section, frozen=True, kw_only=True):
    """The console (`/console` on the admin listener): how much of the newest audit lines
    its request log keeps — `retain` lines (which also bound its size at 1 KiB a line:
    `services/state/log.py`) or `retain_bytes` bytes; both 0: none, the log page is off —
    and the reverse proxies (addresses or networks) whose `X-Forwarded-Proto`/`-Host`/
    `-For` it believes."""

    retain: Annotated[int, RETAIN] = 100_000
    retain_bytes: int = 0  # (from `retain: 50MiB`)
    trusted_proxies: Annotated[tuple[str, ...], NETWORKS] = ("127.0.0.1", "::1")


class IdentityConfig(Section, frozen=True, kw_only=True):
    kubernetes: KubernetesConfig = KubernetesConfig()


def _default_secrets() -> dict[str, Any]:
    return {"store": "file", "path": "secrets.local.yaml", "create_if_missing": True}


def _default_state() -> dict[str, Any]:
    return {"store": "sqlite"}


class Config(Section, frozen=True, kw_only=True):
    """The whole validated configuration."""

    listen: ListenConfig = ListenConfig()
    admin_token: Annotated[str | None, optional(TEXT)] = None
    policies: Annotated[Path, PATH] = Path("policies")
    learn: Annotated[bool, BOOL] = False  # every policy in mode: learn (`run --learn`)
    certs: Annotated[Path, PATH] = Path("certs")
    runtime_dir: Annotated[Path | None, optional(PATH)] = None
    tokens: TokensConfig = TokensConfig()
    secrets: Annotated[Mapping[str, Any], ANY_MAP] = msgspec.field(
        default_factory=_default_secrets)
    network: NetworkConfig = NetworkConfig()
    limits: LimitsConfig = LimitsConfig()
    refusals: RefusalsConfig = RefusalsConfig()
    shutdown: ShutdownConfig = ShutdownConfig()
    dns: DnsConfig = DnsConfig()
    audit: AuditConfig = AuditConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    admin: AdminConfig = AdminConfig()
    state: Annotated[Mapping[str, Any], ANY_MAP] = msgspec.field(default_factory=_default_state)
    metering: MeteringConfig = MeteringConfig()
    identity: IdentityConfig = IdentityConfig()
    approvals: ApprovalsConfig = ApprovalsConfig()
    console: ConsoleConfig = ConsoleConfig()
    dlp: DlpConfig = DlpConfig()
    mcp_oauth: McpOAuthConfig = McpOAuthConfig()
    workers: Annotated[int, COUNT] = 0  # 0 = one worker process per core
    log_level: Annotated[str, LEVEL] = "info"
    source: str = "<defaults>"

    @property
    def signing_dir(self) -> Path:
        return self.tokens.signing_keys or self.certs / "signing"


# --- the schema, walked --------------------------------------------------------------

Spec = Value | type[Section]


def _spec(annotation: Any) -> Spec | None:
    """A field's key: its `Value`, or its `Section` class; None: not a key."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation
    if get_origin(annotation) is Annotated:
        return next((a for a in get_args(annotation)[1:] if isinstance(a, Value)), None)
    return None


@cache
def _fields(section: type[Section]) -> dict[str, tuple[Spec, Any]]:
    """`section`'s keys: name -> (its spec, its default)."""
    out: dict[str, tuple[Spec, Any]] = {}
    for f in msgspec.structs.fields(section):
        spec = _spec(f.type)
        if spec is not None:
            default = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
            out[f.name] = (spec, default)
    return out


def keys(section: type[Section] = Config,
         prefix: str = "") -> Iterator[tuple[str, Value, Any]]:
    """Every key below `section`, dotted, with its `Value` and its default, in order (the
    docs' table and the chart's schema are generated from this: scripts/config-schema.py)."""
    for name, (spec, default) in _fields(section).items():
        if isinstance(spec, Value):
            yield prefix + name, spec, default
        else:
            yield from keys(spec, f"{prefix}{name}.")


def _tree(section: type[Section]) -> dict[str, Any]:
    return {k: s if isinstance(s, Value) else _tree(s) for k, (s, _) in _fields(section).items()}


SCHEMA: Mapping[str, Any] = _tree(Config)  # key -> its Value, or the section's keys


def _read(raw: Mapping[str, Any], section: type[Section], prefix: str = "") -> dict[str, Any]:
    """`raw` read along `section`: each value by its key's `Value`, sections recursively;
    ConfigError naming the first wrong key (in the file's order)."""
    known = _fields(section)
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if key not in known:
            hint = difflib.get_close_matches(str(key), list(known), n=1)
            suggestion = f"; did you mean {prefix}{hint[0]}?" if hint else ""
            raise ConfigError(f"{name}: unknown key{suggestion}")
        spec = known[key][0]
        if isinstance(spec, Value):
            parsed = spec.parse(value, name)
            out.update(zip(spec.into, parsed, strict=True) if spec.into else {key: parsed})
        elif value is not None:  # an empty section: its defaults
            if not isinstance(value, Mapping):
                raise ConfigError(f"{name}: expected a map, got {value!r}")
            out[key] = _read(value, spec, f"{name}.")
    return out


def _build[S: Section](section: type[S], values: Mapping[str, Any]) -> S:
    """`section` from `_read`'s values (its defaults for the keys not given)."""
    known = {k: spec for k, (spec, _) in _fields(section).items() if not isinstance(spec, Value)}
    return section(**{k: _build(known[k], v) if k in known else v for k, v in values.items()})


def _env_yaml(dotted: str) -> bool:
    spec: Any = SCHEMA
    for part in dotted.split("."):
        spec = spec.get(part) if isinstance(spec, Mapping) else None
    return (isinstance(spec, Value) and spec.env_yaml) or dotted.startswith(_ENV_YAML_BELOW)


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for var, text in env.items():
        if not var.startswith(ENV_PREFIX):
            continue
        rest = var[len(ENV_PREFIX):]
        if rest.startswith(_ENV_IGNORED) or not rest:
            continue
        path = [p.lower() for p in rest.split("__")]
        value: Any = text
        if _env_yaml(".".join(path)):
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


def _file(path: Path | str) -> dict[str, Any]:
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
    return loaded or {}


def load_config(path: Path | str | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Load `path` (optional), apply environment overrides, validate, build a Config."""
    env = os.environ if env is None else env
    if path is None and env.get(ENV_PREFIX + "CONFIG"):
        path = env[ENV_PREFIX + "CONFIG"]
    raw = {} if path is None else _file(path)
    base = Path.cwd() if path is None else Path(path).resolve().parent
    source = "<defaults>" if path is None else str(path)
    try:
        values = _read(_merge(raw, _env_overrides(env)), Config)
        network = values.get("network", {})
        if network.get("upstream_proxy") == "env":
            network["upstream_proxy"] = from_environment(env, "network.upstream_proxy: env")
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    cfg = _absolute(_build(Config, {**values, "source": source}), base)
    _check(cfg, source)
    return msgspec.structs.replace(
        cfg, secrets=_secrets(cfg.secrets, base), state=_state(cfg.state, base),
        audit=msgspec.structs.replace(cfg.audit, spill=msgspec.structs.replace(
            cfg.audit.spill, path=cfg.audit.spill.path or _spill_path(cfg, base))))


# --- after the values: paths, and what involves two keys -----------------------------


def _absolute[S: Section](section: S, base: Path) -> S:
    """`section` with every Path made absolute: `~` expanded, relative ones below `base`."""
    changes: dict[str, Any] = {}
    for name in section.__struct_fields__:
        value = getattr(section, name)
        if isinstance(value, Section):
            changes[name] = _absolute(value, base)
        elif isinstance(value, Path):
            changes[name] = _path(base, value)
    return msgspec.structs.replace(section, **changes)


def _path(base: Path, value: str | Path) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else base / p


def _secrets(secrets: Mapping[str, Any], base: Path) -> Mapping[str, Any]:
    out = dict(secrets)
    if isinstance(out.get("path"), str):
        out["path"] = str(_path(base, out["path"]))
    return out


def _state(state: Mapping[str, Any], base: Path) -> Mapping[str, Any]:
    """The `state` section with the SQLite file's path made absolute (relative to the
    config's directory, default `state/gateway.db`)."""
    out = dict(state)
    if out.get("store", "sqlite") == "sqlite":
        raw = out.get("path", "state/gateway.db")
        out["path"] = str(_path(base, raw if isinstance(raw, str) else str(raw)))
    return out


def _spill_path(cfg: Config, base: Path) -> Path:
    """`audit.spill.path` by default: `audit-spill/` in the SQLite state file's directory
    (a volume kept across restarts, apart from the audit file's), else in `runtime_dir`,
    else `state/audit-spill` next to the config."""
    state = _state(cfg.state, base)
    if state.get("store", "sqlite") == "sqlite":
        return Path(str(state["path"])).parent / "audit-spill"
    return (cfg.runtime_dir or base / "state") / "audit-spill"


def _check(cfg: Config, source: str) -> None:
    """What involves two keys."""
    audit, k8s = cfg.audit, cfg.identity.kubernetes
    if audit.spill.max and audit.spill.max < audit.buffer:
        raise ConfigError(f"{source}: audit.spill.max is smaller than audit.buffer (the "
                          "journal takes the buffer's lines at the stop): raise it, or 0 "
                          "for no journal")
    if audit.otlp and cfg.telemetry.endpoint is None:
        raise ConfigError(f"{source}: audit.otlp is true but telemetry.endpoint is not set "
                          "(the collector the audit lines go to, e.g. http://otel-collector:4317)")
    telemetry = cfg.telemetry
    if telemetry.propagate and (telemetry.endpoint is None or not telemetry.traces):
        raise ConfigError(f"{source}: telemetry.propagate needs spans exported "
                          "(telemetry.endpoint set, telemetry.traces true): the upstreams' "
                          "spans would name a parent span that is never exported")
    if cfg.tokens.default_ttl > cfg.tokens.max_ttl:
        raise ConfigError(f"{source}: tokens.default_ttl is longer than tokens.max_ttl")
    if k8s.enabled and not k8s.namespaces:
        raise ConfigError(f"{source}: identity.kubernetes.namespaces: list the sandbox "
                          "namespaces whose pods are watched (e.g. [sandboxes])")
    unwatched = sorted(set(k8s.default_policies) - set(k8s.namespaces))
    if k8s.enabled and unwatched:
        raise ConfigError(f"{source}: identity.kubernetes.default_policies: namespace "
                          f"{unwatched[0]!r} is not in identity.kubernetes.namespaces")
