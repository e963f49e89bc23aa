"""Configuration: defaults, every key, relative paths, env overrides, errors naming the key."""

from __future__ import annotations

import os
import re
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import (
    SCHEMA,
    Config,
    ConfigError,
    HostPort,
    Notifier,
    OAuthClient,
    load_config,
    parse_duration,
    parse_hostport,
)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def config_error(path: Path | None = None, env: Mapping[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, env=env or {})
    return str(info.value)


# --- defaults --------------------------------------------------------------------------


def test_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, env={})
    assert cfg.listen.proxy == HostPort("0.0.0.0", 8080)
    assert str(cfg.listen.proxy) == "0.0.0.0:8080"
    assert cfg.listen.admin == HostPort("127.0.0.1", 8090)
    assert cfg.listen.transparent is None
    assert cfg.listen.dns is None  # the DNS resolver is off unless asked for
    assert (cfg.dns.ttl, cfg.dns.rate, cfg.dns.burst) == (10, 20.0, 50)
    assert cfg.admin_token is None
    assert cfg.policies == tmp_path / "policies"
    assert cfg.certs == tmp_path / "certs"
    assert cfg.signing_dir == tmp_path / "certs" / "signing"
    assert cfg.secrets["store"] == "file"
    assert cfg.secrets["path"] == str(tmp_path / "secrets.local.yaml")
    assert cfg.tokens.default_ttl == 15 * 60
    assert cfg.tokens.max_ttl == 24 * 3600
    assert cfg.tokens.leeway == 0
    assert cfg.tokens.issuer == "sandbox-gateway"
    assert cfg.network.allow_cidrs == ()
    assert cfg.network.upstream_ca is None
    assert dict(cfg.network.resolve) == {}
    assert cfg.network.intercept == "fast"
    assert cfg.audit.path is None
    assert cfg.audit.on_failure == "refuse"  # audit lines that cannot be written: 503
    assert cfg.audit.buffer == 4 * 1024 * 1024
    # the spill journal: next to the SQLite state file (its volume), 64 MiB at most
    assert cfg.audit.spill.path == tmp_path / "state" / "audit-spill"
    assert cfg.audit.spill.max == 64 * 1024 * 1024
    assert (cfg.admin.timeouts.head, cfg.admin.timeouts.body, cfg.admin.timeouts.idle) == (
        10, 30, 30)
    assert cfg.admin.max_body == 2 * 1024 * 1024 and cfg.admin.max_connections == 64
    assert cfg.workers == 0  # one worker per core
    assert cfg.source == "<defaults>"


def test_empty_file_is_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(write(tmp_path / "gateway.yaml", "# nothing\n"), env={})
    assert cfg.listen == Config().listen
    assert cfg.tokens == Config().tokens


@pytest.mark.parametrize(("text", "where"), [
    ("state: {store: sqlite, path: /data/db/gw.db}", "/data/db/audit-spill"),
    ("state: {store: redis, url: 'redis://r:6379'}\nruntime_dir: /run/sg",
     "/run/sg/audit-spill"),
    ("state: {store: redis, url: 'redis://r:6379'}", "{base}/state/audit-spill"),
])
def test_the_audit_spill_journal_defaults_to_the_state_volume(tmp_path: Path, text: str,
                                                              where: str) -> None:
    cfg = load_config(write(tmp_path / "gateway.yaml", text + "\n"), env={})
    assert cfg.audit.spill.path == Path(where.format(base=tmp_path))


# --- a full file -----------------------------------------------------------------------

FULL = """
listen: {proxy: "127.0.0.1:3128", transparent: ":3129", admin: "[::1]:9000", dns: ":5353",
         reachable_from: "the sandboxes' subnet (host firewall)"}
admin_token: adm1n-t0ken-0123456789
policies: pol
learn: false
certs: /etc/sg/certs
runtime_dir: run
tokens:
  default_ttl: 10m
  max_ttl: 2h
  max_lifetime: 1d
  leeway: 5
  issuer: gw-eu
  signing_keys: keys
  retired_kids: [k1, k2]
secrets: {store: file, path: secrets/local.yaml}
network:
  allow_cidrs: [10.0.0.0/8, "fd00::/8"]
  deny_cidrs: [10.1.0.0/16]
  upstream_ca: ca/upstream.pem
  resolve: {api.internal.example: "10.1.2.3:443"}
  upstream_idle_timeout: 45s
  intercept: mitmproxy
  upstream_proxy: {url: "http://proxy.corp:3128", credentials: corp-proxy, no_proxy: [.corp],
                   connect_to: address, check_ready: true}
  timeouts: {connect: 5s, read: 10m, client_idle: 20m, handshake: 15s}
limits: {connections_per_sandbox: 64, max_header_bytes: 32k, max_websocket_message: 4m,
         max_tunnel_lifetime: 12h, memory: 768MiB, unpacked_excess: 512m,
         unpacked_excess_rate: 32m}
shutdown: {drain: 45s}
refusals: {inside_tls: false}
dns: {ttl: 30s, rate: 2.5, burst: 8}
audit: {path: audit/decisions.jsonl, on_failure: continue, buffer: 1m,
        spill: {path: /var/spool/sg, max: 256m}, otlp: true}
telemetry: {endpoint: "https://otel.corp:4318", protocol: http, headers: {x-auth: a1},
            traces: false, metrics: false, sample: 0.25, service_name: sg-eu, queue: 100,
            metrics_interval: 15s, propagate: []}
admin: {timeouts: {head: 5s, body: 20s, idle: 1m}, max_body: 512k, max_connections: 16}
state: {store: memory}
metering: {pricing: prices.yaml, retention: 30d, stream_usage: false}
identity:
  kubernetes:
    enabled: true
    kubeconfig: kube/config
    namespaces: [sandboxes, jobs]
    policy_label: example.com/policy
    default_policies: {jobs: batch}
    pod_selector: "tier=agent"
    stale_after: 45s
    exchange: {enabled: true, audience: gw, verify: oidc, ttl: 30m,
               issuer: "https://kubernetes.default.svc"}
approvals:
  notify:
    ops: {url: "https://hooks.example/T/B", format: slack}
    pager: {url: "https://pager.example/ask", secret: pager-key}
  retention: 2d
  proposals: props
console: {retain: 5000, trusted_proxies: [10.1.0.0/16, "fd00::7"]}
dlp: {salt_file: dlp-salt}
mcp_oauth:
  clients:
    github: {client_id: Iv1.abc, secret: github-oauth-secret}
    public: {client_id: gw-public}
  key_file: oauth-key
  key_secret: mcp-oauth-key
  redirect_url: https://gateway.example/v1/mcp/oauth/callback
  client_metadata_url: https://gateway.example/oauth/client.json
workers: 4
log_level: debug
"""


def _missing_keys(schema: Mapping[str, Any], data: Mapping[str, Any], prefix: str = "") -> set[str]:
    missing: set[str] = set()
    for key, spec in schema.items():
        if key not in data:
            missing.add(prefix + key)
        elif isinstance(spec, Mapping):
            missing |= _missing_keys(spec, data[key], f"{prefix}{key}.")
    return missing


def test_full_file_covers_every_key() -> None:
    import yaml

    assert _missing_keys(SCHEMA, yaml.safe_load(FULL)) == set()


def test_full_file(tmp_path: Path) -> None:
    path = write(tmp_path / "conf" / "gateway.yaml", FULL)
    cfg = load_config(path, env={})
    base = tmp_path / "conf"
    assert cfg.listen.proxy == HostPort("127.0.0.1", 3128)
    assert cfg.listen.transparent == HostPort("0.0.0.0", 3129)
    assert cfg.listen.admin == HostPort("::1", 9000)
    assert str(cfg.listen.admin) == "[::1]:9000"
    assert cfg.listen.dns == HostPort("0.0.0.0", 5353)
    assert (cfg.dns.ttl, cfg.dns.rate, cfg.dns.burst) == (30, 2.5, 8)
    assert cfg.admin_token == "adm1n-t0ken-0123456789"
    assert cfg.policies == base / "pol"                       # relative: to the file
    assert cfg.certs == Path("/etc/sg/certs")                 # absolute: as is
    assert cfg.runtime_dir == base / "run"
    assert cfg.tokens.default_ttl == 600
    assert cfg.tokens.max_ttl == 7200
    assert cfg.tokens.max_lifetime == 86400
    assert cfg.tokens.leeway == 5.0
    assert cfg.tokens.issuer == "gw-eu"
    assert cfg.tokens.signing_keys == base / "keys"
    assert cfg.signing_dir == base / "keys"
    assert cfg.tokens.retired_kids == ("k1", "k2")
    assert cfg.secrets == {"store": "file", "path": str(base / "secrets" / "local.yaml")}
    assert cfg.network.allow_cidrs == ("10.0.0.0/8", "fd00::/8")
    assert cfg.network.deny_cidrs == ("10.1.0.0/16",)
    assert cfg.network.upstream_ca == base / "ca" / "upstream.pem"
    assert dict(cfg.network.resolve) == {"api.internal.example": "10.1.2.3:443"}
    assert cfg.network.upstream_idle_timeout == 45
    assert cfg.refusals.inside_tls is False and Config().refusals.inside_tls is True
    assert cfg.network.intercept == "mitmproxy"
    assert cfg.audit.path == base / "audit" / "decisions.jsonl"
    assert cfg.audit.on_failure == "continue" and cfg.audit.buffer == 1024 * 1024
    assert cfg.audit.spill.path == Path("/var/spool/sg")
    assert cfg.audit.spill.max == 256 * 1024 * 1024
    assert cfg.audit.otlp is True and Config().telemetry.endpoint is None
    tel = cfg.telemetry
    assert (tel.endpoint, tel.protocol, dict(tel.headers)) == (
        "https://otel.corp:4318", "http", {"x-auth": "a1"})
    assert (tel.traces, tel.metrics, tel.sample, tel.service_name, tel.queue,
            tel.metrics_interval, tel.propagate) == (False, False, 0.25, "sg-eu", 100, 15, ())
    assert (cfg.admin.timeouts.head, cfg.admin.timeouts.body, cfg.admin.timeouts.idle) == (
        5, 20, 60)
    assert cfg.admin.max_body == 512 * 1024 and cfg.admin.max_connections == 16
    assert dict(cfg.state) == {"store": "memory"}
    assert cfg.metering.pricing == base / "prices.yaml"
    assert cfg.metering.retention == 30 * 86400
    assert cfg.metering.stream_usage is False
    assert dict(cfg.approvals.notify) == {
        "ops": Notifier("https://hooks.example/T/B", "slack", None),
        "pager": Notifier("https://pager.example/ask", "json", "pager-key")}
    assert cfg.approvals.retention == 2 * 86400
    assert cfg.approvals.proposals == base / "props"
    assert cfg.console.retain == 5000 and cfg.console.retain_bytes == 0
    assert cfg.limits.memory == 768 * 1024 * 1024 and cfg.limits.memory_percent == 0
    assert cfg.console.trusted_proxies == ("10.1.0.0/16", "fd00::7")
    assert cfg.dlp.salt_file == base / "dlp-salt"
    assert cfg.mcp_oauth.clients == {"github": OAuthClient("Iv1.abc", "github-oauth-secret"),
                                      "public": OAuthClient("gw-public")}
    assert cfg.mcp_oauth.key_secret == "mcp-oauth-key"
    assert cfg.mcp_oauth.key_file == base / "oauth-key"
    assert cfg.mcp_oauth.redirect_url == "https://gateway.example/v1/mcp/oauth/callback"
    assert cfg.workers == 4
    assert cfg.log_level == "debug"
    assert cfg.source == str(path)


def test_relative_paths_follow_the_file_not_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path / "etc" / "gateway.yaml", "policies: ./p\ncerts: ../c\n")
    monkeypatch.chdir(tmp_path / "etc")
    cfg = load_config(Path("gateway.yaml"), env={})
    assert cfg.policies == path.parent / "p"
    assert cfg.certs.resolve() == tmp_path / "c"


def test_home_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = load_config(write(tmp_path / "g.yaml", "certs: ~/certs\n"), env={})
    assert cfg.certs == tmp_path / "home" / "certs"


def test_config_file_from_env(tmp_path: Path) -> None:
    path = write(tmp_path / "g.yaml", "workers: 3\n")
    cfg = load_config(None, env={"SANDBOX_GATEWAY_CONFIG": str(path)})
    assert cfg.workers == 3 and cfg.source == str(path)


# --- environment overrides -------------------------------------------------------------

ENV_CASES: list[tuple[dict[str, str], str, Any]] = [
    ({"SANDBOX_GATEWAY_ADMIN_TOKEN": "from-env-0123456789"}, "admin_token",
     "from-env-0123456789"),
    ({"SANDBOX_GATEWAY_LISTEN__PROXY": "0.0.0.0:3128"}, "listen.proxy",
     HostPort("0.0.0.0", 3128)),
    ({"SANDBOX_GATEWAY_LISTEN__ADMIN": "[::]:9999"}, "listen.admin", HostPort("::", 9999)),
    ({"SANDBOX_GATEWAY_TOKENS__MAX_TTL": "2h"}, "tokens.max_ttl", 7200.0),
    ({"SANDBOX_GATEWAY_TOKENS__DEFAULT_TTL": "300"}, "tokens.default_ttl", 300.0),
    ({"SANDBOX_GATEWAY_TOKENS__LEEWAY": "2.5"}, "tokens.leeway", 2.5),
    ({"SANDBOX_GATEWAY_TOKENS__RETIRED_KIDS": "[a, b]"}, "tokens.retired_kids", ("a", "b")),
    ({"SANDBOX_GATEWAY_NETWORK__ALLOW_CIDRS": '["10.0.0.0/8"]'}, "network.allow_cidrs",
     ("10.0.0.0/8",)),
    ({"SANDBOX_GATEWAY_NETWORK__RESOLVE": '{"a.example": "127.0.0.1:443"}'},
     "network.resolve", {"a.example": "127.0.0.1:443"}),
    ({"SANDBOX_GATEWAY_WORKERS": "4"}, "workers", 4),
    ({"SANDBOX_GATEWAY_CONSOLE__TRUSTED_PROXIES": '["10.0.0.5"]'}, "console.trusted_proxies",
     ("10.0.0.5",)),
    ({"OTHER": "x"}, "console.trusted_proxies", ("127.0.0.1", "::1")),
    ({"SANDBOX_GATEWAY_LISTEN__DNS": "0.0.0.0:53"}, "listen.dns", HostPort("0.0.0.0", 53)),
    ({"SANDBOX_GATEWAY_DNS__TTL": "5s"}, "dns.ttl", 5),
    ({"SANDBOX_GATEWAY_DNS__RATE": "7.5"}, "dns.rate", 7.5),
    ({"SANDBOX_GATEWAY_DNS__BURST": "15"}, "dns.burst", 15),
    ({"SANDBOX_GATEWAY_LOG_LEVEL": "warning"}, "log_level", "warning"),
    ({"SANDBOX_GATEWAY_AUDIT__ON_FAILURE": "continue"}, "audit.on_failure", "continue"),
    ({"SANDBOX_GATEWAY_AUDIT__BUFFER": "16m"}, "audit.buffer", 16 * 1024 * 1024),
    ({"SANDBOX_GATEWAY_AUDIT__SPILL__MAX": "0"}, "audit.spill.max", 0),
    ({"SANDBOX_GATEWAY_AUDIT__SPILL__PATH": "/spool"}, "audit.spill.path", Path("/spool")),
    ({"SANDBOX_GATEWAY_ADMIN__TIMEOUTS__HEAD": "3s"}, "admin.timeouts.head", 3.0),
    ({"SANDBOX_GATEWAY_ADMIN__MAX_BODY": "1m"}, "admin.max_body", 1024 * 1024),
    ({"SANDBOX_GATEWAY_ADMIN__MAX_CONNECTIONS": "8"}, "admin.max_connections", 8),
    ({"SANDBOX_GATEWAY_SECRETS": "{store: env}"}, "secrets", {"store": "env"}),
    ({"SANDBOX_GATEWAY_SECRETS__STORE": "env"}, "secrets.store", "env"),
    ({"SANDBOX_GATEWAY_STATE__STORE": "redis", "SANDBOX_GATEWAY_STATE__URL": "redis://r:6379"},
     "state", {"store": "redis", "url": "redis://r:6379"}),
    # Not configuration: the env secret store's variables, and other programs' variables.
    ({"SANDBOX_GATEWAY_SECRET_FOO": "sk-secret", "SANDBOX_GATEWAYX": "1", "OTHER": "x"},
     "workers", 0),
]


def _get(cfg: Config, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = value[part] if isinstance(value, Mapping) else getattr(value, part)
    if isinstance(value, Mapping):
        return dict(value)
    return value


@pytest.mark.parametrize(("env", "key", "expected"), ENV_CASES,
                         ids=[next(iter(c[0])) for c in ENV_CASES])
def test_env_override(tmp_path: Path, env: dict[str, str], key: str, expected: Any) -> None:
    assert _get(load_config(None, env=env), key) == expected


def test_env_overrides_file_and_merges(tmp_path: Path) -> None:
    path = write(tmp_path / "g.yaml", """
        listen: {proxy: "127.0.0.1:1111", admin: "127.0.0.1:2222"}
        tokens: {max_ttl: 1h}
        network: {allow_cidrs: [192.168.0.0/16]}
    """)
    cfg = load_config(path, env={
        "SANDBOX_GATEWAY_LISTEN__PROXY": "0.0.0.0:3128",
        "SANDBOX_GATEWAY_TOKENS__MAX_TTL": "2h",
        "SANDBOX_GATEWAY_NETWORK__ALLOW_CIDRS": '["10.0.0.0/8"]',
    })
    assert cfg.listen.proxy == HostPort("0.0.0.0", 3128)
    assert cfg.listen.admin == HostPort("127.0.0.1", 2222)    # kept from the file
    assert cfg.tokens.max_ttl == 7200
    assert cfg.network.allow_cidrs == ("10.0.0.0/8",)         # replaced, not appended


def test_process_environment_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in [v for v in os.environ if v.startswith("SANDBOX_GATEWAY_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("SANDBOX_GATEWAY_WORKERS", "2")
    monkeypatch.setenv("SANDBOX_GATEWAY_SECRET_OPENAI", "sk-not-config")
    assert load_config().workers == 2


# --- errors name the key ---------------------------------------------------------------

FILE_ERRORS = [
    ("approvals: {notify: [ops]}", "approvals.notify: expected a map of notifiers"),
    ("console: {retain: -1}", "console.retain: expected a non-negative integer"),
    ("console: {retain: 20000000}", "console.retain: at most 10000000 lines"),
    ("console: {retain: 512k}", "console.retain: a size between 1MiB and 16GiB"),
    ("console: {retain: lots}", "console.retain: 'lots' is neither a number of lines"),
    ("limits: {memory: 32MiB}", "limits.memory: at least 64MiB"),
    ("limits: {memory: 120%}", "limits.memory: '120%': a percentage"),
    ("limits: {memory: lots}", "limits.memory: 'lots' is not a size"),
    ("console: {trusted_proxies: [nginx.internal]}",
     "console.trusted_proxies: 'nginx.internal' is not an address or network"),
    ("console: {trusted_proxies: 10.0.0.1}", "console.trusted_proxies: expected a list"),
    ("approvals: {notify: {ops: {url: 'ftp://x'}}}",
     "approvals.notify.ops.url: expected an http(s) URL"),
    ("approvals: {notify: {ops: {url: 'https://x', format: xml}}}",
     "approvals.notify.ops.format: expected json or slack"),
    ("approvals: {notify: {ops: {url: 'https://x', token: y}}}",
     "approvals.notify.ops: expected {url, format, secret}"),
    ("approvals: {notify: {'a b': {url: 'https://x'}}}", "is not a notifier name"),
    ("listne: {proxy: ':1'}", "listne: unknown key; did you mean listen?"),
    ("tokens: {max_tl: 1h}", "tokens.max_tl: unknown key; did you mean tokens.max_ttl?"),
    ("zzz: 1", "zzz: unknown key"),
    ("workers: four", "workers: expected a non-negative integer"),
    ("workers: -1", "workers: expected a non-negative integer"),
    ("workers: true", "workers: expected a non-negative integer"),
    ("listen: 8080", "listen: expected a map"),
    ("policies: 5", "policies: expected a non-empty string"),
    ("admin_token: ''", "admin_token: expected a non-empty string"),
    ("tokens: {default_ttl: soon}", "tokens.default_ttl: 'soon' is not a duration"),
    ("tokens: {max_ttl: 0}", "tokens.max_ttl: must be positive"),
    ("tokens: {max_ttl: [1]}", "tokens.max_ttl: expected a duration"),
    ("tokens: {leeway: -1}", "tokens.leeway: expected seconds"),
    ("tokens: {leeway: 5s}", "tokens.leeway: expected seconds"),
    ("tokens: {retired_kids: k1}", "tokens.retired_kids: expected a list of strings"),
    ("listen: {proxy: '8080'}", 'listen.proxy: expected "host:port"'),
    ("listen: {proxy: 8080}", 'listen.proxy: expected "host:port"'),
    ("listen: {admin: 'localhost:http'}", 'listen.admin: expected "host:port"'),
    ("listen: {admin: '127.0.0.1:70000'}", "listen.admin: port must be between 0 and 65535"),
    ("tokens: {default_ttl: 2h, max_ttl: 1h}",
     "tokens.default_ttl is longer than tokens.max_ttl"),
    ("tokens: {max_ttl: 5m}", "tokens.default_ttl is longer than tokens.max_ttl"),
    ("network: {allow_cidrs: 10.0.0.0/8}", "network.allow_cidrs: expected a list of strings"),
    ("network: {resolve: [a]}", "network.resolve: expected a map of strings"),
    ("secrets: file", "secrets: expected a map"),
    ("log_level: loud", "log_level: expected one of debug, info, warning, error"),
    ("audit: {path: 3}", "audit.path: expected a non-empty string"),
    ("audit: {on_failure: ignore}", "audit.on_failure: expected refuse"),
    ("audit: {otlp: true}", "audit.otlp is true but telemetry.endpoint is not set"),
    ("telemetry: {endpoint: otel:4317}", "telemetry.endpoint: expected the collector's URL"),
    ("telemetry: {endpoint: 'http://otel:4318/v1/traces'}",
     "telemetry.endpoint: expected the collector's URL"),
    ("telemetry: {protocol: http/json}", "telemetry.protocol: expected grpc"),
    ("telemetry: {sample: 1.5}", "telemetry.sample: expected a ratio from 0 to 1"),
    ("telemetry: {propagate: [api.example.com]}",
     "telemetry.propagate needs spans exported"),
    ("telemetry: {endpoint: 'http://otel:4317', traces: false, propagate: [a.example.com]}",
     "telemetry.propagate needs spans exported"),
    ("telemetry: {endpoint: 'http://otel:4317', propagate: api.example.com}",
     "telemetry.propagate: expected a list of strings"),
    ("telemetry: {endpoint: 'http://otel:4317', propagate: ['api..example.com']}",
     "telemetry.propagate: 'api..example.com'"),
    ("audit: {buffer: 4k}", "audit.buffer: at least 64k"),
    ("audit: {buffer: lots}", "audit.buffer: 'lots' is not a size"),
    ("audit: {spill: {max: 4k}}", "audit.spill.max: 0 (no spill journal) or at least 64k"),
    ("audit: {buffer: 8m, spill: {max: 4m}}", "audit.spill.max is smaller than audit.buffer"),
    ("audit: {spill: /var/spool}", "audit.spill: expected a map"),
    ("admin: {timeouts: {head: 0}}", "admin.timeouts.head: must be positive"),
    ("admin: {timeouts: {header: 5s}}",
     "admin.timeouts.header: unknown key; did you mean admin.timeouts.head?"),
    ("admin: {max_body: -1}", "admin.max_body: expected a positive integer"),
    ("admin: {max_connections: 0}", "admin.max_connections: expected a positive integer"),
    ("listen: {dns: 53}", 'listen.dns: expected "host:port"'),
    ("dns: {ttl: 2h}", "dns.ttl: expected between 1s and 1h"),
    ("dns: {ttl: 0}", "dns.ttl: must be positive"),
    ("dns: {rate: 0}", "dns.rate: expected queries per second"),
    ("dns: {rate: fast}", "dns.rate: expected queries per second"),
    ("dns: {burst: 0.5}", "dns.burst: expected a positive integer"),
    ("dns: {brust: 5}", "dns.brust: unknown key; did you mean dns.burst?"),
    ("- a\n- b", "expected a map of settings at the top level"),
    ("just a string", "expected a map of settings at the top level"),
    ("listen: {proxy: [", "not valid YAML"),
]


@pytest.mark.parametrize(("text", "message"), FILE_ERRORS)
def test_file_errors(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path / "gateway.yaml", text + "\n")
    error = config_error(path)
    assert message in error
    assert error.startswith(str(path) + ": ")


ENV_ERRORS = [
    ({"SANDBOX_GATEWAY_WORKERS": "many"}, "workers: expected a non-negative integer"),
    ({"SANDBOX_GATEWAY_LISTEN__PROXY": "nope"}, 'listen.proxy: expected "host:port"'),
    ({"SANDBOX_GATEWAY_TOKENS__MAX_TTL": "forever"}, "tokens.max_ttl: 'forever' is not"),
    ({"SANDBOX_GATEWAY_NETWORK__ALLOW_CIDRS": "[unclosed"}, "NETWORK__ALLOW_CIDRS: not valid"),
    ({"SANDBOX_GATEWAY_AUDIT__ON_FAILURE": "drop"}, "audit.on_failure: expected refuse"),
    ({"SANDBOX_GATEWAY_LISTEN__PROXXY": "0.0.0.0:1"},
     "listen.proxxy: unknown key; did you mean listen.proxy?"),
]


@pytest.mark.parametrize(("env", "message"), ENV_ERRORS, ids=[e[1][:20] for e in ENV_ERRORS])
def test_env_errors(env: dict[str, str], message: str) -> None:
    assert message in config_error(None, env)


@pytest.mark.parametrize("kind", ["missing", "directory", "unreadable", "binary"])
def test_unreadable_file(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "gateway.yaml"
    if kind == "directory":
        path.mkdir()
    elif kind == "unreadable":
        if os.geteuid() == 0:
            pytest.skip("root reads any file")
        path.write_text("workers: 1\n")
        path.chmod(0)
    elif kind == "binary":
        path.write_bytes(b"\xff\xfe\x00garbage\x80")
    error = config_error(path)
    assert error.startswith(str(path) + ": ")
    assert "cannot read" in error or "not valid" in error


# --- value parsers ---------------------------------------------------------------------

DURATIONS: list[tuple[object, float]] = [
    ("90s", 90), ("15m", 900), ("1h30m", 5400), ("2d", 172800), ("1h", 3600),
    ("500ms", 0.5), ("1.5h", 5400), (" 15M ", 900), ("1d2h3m4s", 93784),
    ("30", 30), ("2.5", 2.5), (30, 30), (2.5, 2.5),
]


@pytest.mark.parametrize(("value", "seconds"), DURATIONS)
def test_parse_duration(value: object, seconds: float) -> None:
    assert parse_duration(value, "k") == pytest.approx(seconds)


@pytest.mark.parametrize(
    "value", ["", "abc", "15x", "m15", "1h 30m", "15 m", "-5", "-5m", "h", "1.h", 0, -1, "0s",
              True, None, [15], {"m": 1}],
)
def test_parse_duration_refuses(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^tokens\.x: "):
        parse_duration(value, "tokens.x")


HOSTPORTS = [
    ("0.0.0.0:8080", HostPort("0.0.0.0", 8080)),
    ("127.0.0.1:0", HostPort("127.0.0.1", 0)),
    (":3128", HostPort("0.0.0.0", 3128)),
    ("localhost:65535", HostPort("localhost", 65535)),
    ("[::1]:8090", HostPort("::1", 8090)),
    ("[::]:1", HostPort("::", 1)),
    (" gateway:8080 ", HostPort("gateway", 8080)),
]


@pytest.mark.parametrize(("text", "expected"), HOSTPORTS)
def test_parse_hostport(text: str, expected: HostPort) -> None:
    parsed = parse_hostport(text, "listen.proxy")
    assert parsed == expected
    assert parse_hostport(str(parsed), "listen.proxy") == parsed


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("8080", "expected"), ("host:", "expected"), ("host:port", "expected"),
        ("[::1]", "expected"), ("::1:80", "expected"), ("a:b:1", "expected"),
        (8080, "expected"), (None, "expected"),
        ("1.2.3.4:65536", "port must be between 0 and 65535"),
        ("1.2.3.4:99999999", "port must be between 0 and 65535"),
    ],
)
def test_parse_hostport_refuses(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"^listen\.admin: {message}"):
        parse_hostport(value, "listen.admin")


def test_intercept_engine_choice(tmp_path: Path) -> None:
    env = {"SANDBOX_GATEWAY_NETWORK__INTERCEPT": "mitmproxy"}
    assert load_config(None, env=env).network.intercept == "mitmproxy"
    message = config_error(env={"SANDBOX_GATEWAY_NETWORK__INTERCEPT": "h11"})
    assert "network.intercept: expected fast or mitmproxy, got 'h11'" in message


@pytest.mark.parametrize(("raw", "message"), [
    ({"enabled": True}, "identity.kubernetes.namespaces: list the sandbox namespaces"),
    ({"enabled": True, "namespaces": ["a"], "default_policies": {"b": "p"}},
     "namespace 'b' is not in identity.kubernetes.namespaces"),
    ({"exchange": {"verify": "magic"}}, "expected tokenreview"),
    ({"stale_after": "soon"}, "stale_after"),
    ({"namespace": ["a"]}, "did you mean identity.kubernetes.namespaces"),
])
def test_kubernetes_identity_errors(tmp_path: Path, raw: dict[str, Any], message: str) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump({"identity": {"kubernetes": raw}}))
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(path, env={})


def test_kubernetes_identity_from_env() -> None:
    cfg = load_config(env={"SANDBOX_GATEWAY_IDENTITY__KUBERNETES__ENABLED": "true",
                           "SANDBOX_GATEWAY_IDENTITY__KUBERNETES__NAMESPACES": "[sb, jobs]",
                           "SANDBOX_GATEWAY_IDENTITY__KUBERNETES__EXCHANGE__VERIFY": "oidc"})
    k8s = cfg.identity.kubernetes
    assert (k8s.enabled, k8s.namespaces, k8s.exchange.verify) == (True, ("sb", "jobs"), "oidc")
    assert (k8s.stale_after, k8s.exchange.audience, k8s.exchange.ttl) == (
        30.0, "sandbox-gateway", 3600.0)


@pytest.mark.parametrize(("text", "lines", "size"), [
    ("console: {retain: 100000}", 100_000, 0),
    ("console: {retain: 50MiB}", 0, 50 * 1024 * 1024),
    ("console: {retain: 2g}", 0, 2 * 1024**3),
    ("console: {retain: 0}", 0, 0),
    ("", 100_000, 0),
])
def test_console_retain_in_lines_or_bytes(tmp_path: Path, text: str, lines: int,
                                          size: int) -> None:
    cfg = load_config(write(tmp_path / "gateway.yaml", text or "{}"), env={})
    assert (cfg.console.retain, cfg.console.retain_bytes) == (lines, size)


@pytest.mark.parametrize(("text", "size", "percent"), [
    ("limits: {memory: 512MiB}", 512 * 1024 * 1024, 0.0),
    ("limits: {memory: 85%}", 0, 85.0),
    ("limits: {memory: 0}", 0, 0.0),
    ("", 0, 0.0),
])
def test_limits_memory_in_bytes_or_a_share(tmp_path: Path, text: str, size: int,
                                           percent: float) -> None:
    cfg = load_config(write(tmp_path / "gateway.yaml", text or "{}"), env={})
    assert (cfg.limits.memory, cfg.limits.memory_percent) == (size, percent)
