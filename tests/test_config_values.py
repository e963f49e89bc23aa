"""The config's value readers (gateway/config_values.py), each with its JSON Schema: what a
reader takes its schema takes (the chart never refuses a value the gateway reads), and the
mistakes the schema can see it refuses with the reader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gateway import config_values as v
from gateway.config_values import HostPort, Notifier, OAuthClient, Value
from gateway.errors import ConfigError

MiB = 1024 * 1024

# (value reader, what is written, what it reads)
READS: list[tuple[str, object, object]] = [
    ("DURATION", "90s", 90.0), ("DURATION", "1h30m", 5400.0), ("DURATION", 2.5, 2.5),
    ("DURATION", " 15M ", 900.0), ("DURATION", "30", 30.0),
    ("IDLE", 0, 0.0), ("IDLE", "0", 0.0), ("IDLE", "off", 0.0), ("IDLE", "5m", 300.0),
    ("LEEWAY", 0, 0.0), ("LEEWAY", 2.5, 2.5),
    ("HOSTPORT", ":3128", HostPort("0.0.0.0", 3128)), ("HOSTPORT", "[::1]:80", HostPort("::1", 80)),
    ("TEXT", "x", "x"), ("PATH", "a/b", Path("a/b")), ("STRING", "", ""),
    ("RATIO", 0, 0.0), ("RATIO", 0.1, 0.1), ("RATIO", 1, 1.0),
    ("OTLP_PROTOCOL", "grpc", "grpc"), ("OTLP_PROTOCOL", "http", "http"),
    ("ENDPOINT", "http://otel-collector:4317", "http://otel-collector:4317"),
    ("ENDPOINT", "https://c.example:4318/", "https://c.example:4318"),
    ("STR_LIST", ["a", "b"], ("a", "b")), ("STR_MAP", {"a": "b"}, {"a": "b"}),
    ("ANY_MAP", {"store": "env"}, {"store": "env"}),
    ("COUNT", 0, 0), ("POSITIVE", 3, 3), ("BURST", 1, 1), ("RATE", 0.5, 0.5),
    ("BOOL", False, False),
    ("SIZE", 65536, 65536), ("SIZE", "64k", 65536), ("SIZE", "16MiB", 16 * MiB),
    ("SIZE", "1 g", 1024 * MiB),
    ("AUDIT_BUFFER", "64k", 65536), ("SPILL_MAX", 0, 0), ("SPILL_MAX", "0", 0),
    ("SPILL_MAX", "256m", 256 * MiB),
    ("MEMORY", "85%", (0, 85.0)), ("MEMORY", "512MiB", (512 * MiB, 0.0)), ("MEMORY", 0, (0, 0.0)),
    ("MEMORY", "0", (0, 0.0)), ("MEMORY", 128 * MiB, (128 * MiB, 0.0)),
    ("RETAIN", 5000, (5000, 0)), ("RETAIN", "5000", (5000, 0)), ("RETAIN", "50MiB", (0, 50 * MiB)),
    ("RETAIN", 0, (0, 0)),
    ("NETWORKS", ["10.0.0.0/8", "::1"], ("10.0.0.0/8", "::1")),
    ("HOST_PATTERNS", ["api.example.com", "*.corp.example", "**.internal.example"],
     ("api.example.com", "*.corp.example", "**.internal.example")),
    ("DNS_TTL", "30s", 30), ("DNS_TTL", 1, 1), ("DNS_TTL", "1h", 3600),
    ("INTERCEPT", "mitmproxy", "mitmproxy"), ("ON_FAILURE", "continue", "continue"),
    ("VERIFY", "oidc", "oidc"), ("LEVEL", "debug", "debug"),
    ("NOTIFIERS", {"ops": {"url": "https://hooks.example/T", "format": "slack"}},
     {"ops": Notifier("https://hooks.example/T", "slack", None)}),
    ("UPSTREAM_PROXY", None, None), ("UPSTREAM_PROXY", "env", "env"),
    ("OAUTH_CLIENTS", {"github": {"client_id": "Iv1.abc", "secret": "gh-oauth"}},
     {"github": OAuthClient("Iv1.abc", "gh-oauth")}),
    ("OAUTH_CLIENTS", {"pub.lic": {"client_id": "x"}}, {"pub.lic": OAuthClient("x", None)}),
]

# (value reader, what is written, the reader's message, whether the schema sees it too)
REFUSES: list[tuple[str, object, str, bool]] = [
    ("OAUTH_CLIENTS", ["github"], "expected a map of clients", True),
    ("OAUTH_CLIENTS", {"auto": {"client_id": "x"}}, "is not a client name", False),
    ("OAUTH_CLIENTS", {"gh": {"client_id": "x", "scope": "y"}}, "expected {client_id, secret}",
     True),
    ("OAUTH_CLIENTS", {"gh": {"secret": "s"}}, "client_id", True),
    ("DURATION", "soon", "'soon' is not a duration", True),
    ("RATIO", 1.5, "expected a ratio from 0 to 1", True),
    ("RATIO", True, "expected a ratio from 0 to 1", True),
    ("OTLP_PROTOCOL", "udp", "expected grpc", True),
    ("ENDPOINT", "otel:4317", "without a path", True),
    ("ENDPOINT", "http://otel:4317/v1/traces", "without a path", True),
    ("DURATION", 0, "must be positive", True),
    ("DURATION", [1], "expected a duration", True),
    ("IDLE", "never", "is not a duration", True),
    ("LEEWAY", "5s", "expected seconds", True), ("LEEWAY", -1, "expected seconds", True),
    ("HOSTPORT", "8080", 'expected "host:port"', True),
    ("HOSTPORT", 8080, 'expected "host:port"', True),
    ("HOSTPORT", "1.2.3.4:70000", "port must be between 0 and 65535", False),
    ("TEXT", "", "expected a non-empty string", True), ("PATH", 5, "expected a non-empty", True),
    ("STR_LIST", "a", "expected a list of strings", True),
    ("STR_MAP", ["a"], "expected a map of strings", True),
    ("ANY_MAP", "file", "expected a map", True),
    ("COUNT", -1, "expected a non-negative integer", True),
    ("COUNT", True, "expected a non-negative integer", True),
    ("COUNT", "four", "expected a non-negative integer", True),
    ("POSITIVE", 0, "expected a positive integer", True),
    ("BURST", 0.5, "expected a positive integer", True),
    ("RATE", 0, "expected queries per second", True),
    ("BOOL", "yes", "expected true or false", True),
    ("SIZE", "lots", "'lots' is not a size", True), ("SIZE", -1, "expected a positive", True),
    ("AUDIT_BUFFER", "4k", "at least 64k", False),
    ("SPILL_MAX", "4k", "0 (no spill journal) or at least 64k", False),
    ("MEMORY", "lots", "'lots' is not a size", True),
    ("MEMORY", "120%", "'120%': a percentage", False),
    ("MEMORY", "32MiB", "at least 64MiB", False),
    ("RETAIN", -1, "expected a non-negative integer", True),
    ("RETAIN", 20_000_000, "at most 10000000 lines", True),
    ("RETAIN", "lots", "is neither a number of lines", True),
    ("RETAIN", "512k", "a size between 1MiB and 16GiB", False),
    ("NETWORKS", ["nginx.internal"], "is not an address or network", False),
    ("HOST_PATTERNS", ["api..example.com"], "'api..example.com'", False),
    ("HOST_PATTERNS", "api.example.com", "expected a list", True),
    ("NETWORKS", "10.0.0.1", "expected a list", True),
    ("DNS_TTL", "2h", "expected between 1s and 1h", False),
    ("DNS_TTL", 7200, "expected between 1s and 1h", True),
    ("INTERCEPT", "h11", "expected fast or mitmproxy", True),
    ("ON_FAILURE", "ignore", "expected refuse", True),
    ("VERIFY", "magic", "expected tokenreview", True),
    ("LEVEL", "loud", "expected one of debug, info, warning, error", True),
    ("NOTIFIERS", ["ops"], "expected a map of notifiers", True),
    ("NOTIFIERS", {"ops": {"url": "ftp://x"}}, "k.ops.url: expected an http(s) URL", True),
    ("NOTIFIERS", {"ops": {"url": "https://x", "token": "y"}}, "expected {url, format, secret}",
     True),
    ("UPSTREAM_PROXY", {"url": "http://p:3128", "nope": 1}, "k.nope: unknown key", True),
    ("UPSTREAM_PROXY", "direct", "expected a map", True),
]


def _value(name: str) -> Value:
    value = getattr(v, name)
    assert isinstance(value, Value)
    return value


def _schema_takes(value: Value, written: object) -> bool:
    return jsonschema.Draft7Validator(value.schema).is_valid(written)  # the chart's draft


@pytest.mark.parametrize(("name", "written", "read"), READS)
def test_a_value_is_read(name: str, written: object, read: object) -> None:
    assert _value(name).parse(written, "k") == read


@pytest.mark.parametrize(("name", "written", "read"), READS)
def test_the_schema_takes_what_the_reader_reads(name: str, written: object, read: object) -> None:
    assert _schema_takes(_value(name), written)


@pytest.mark.parametrize(("name", "written", "message", "schema_sees"), REFUSES)
def test_a_wrong_value_is_refused_naming_its_key(name: str, written: object, message: str,
                                                 schema_sees: bool) -> None:
    with pytest.raises(ConfigError, match=r"^k[:.]") as info:
        _value(name).parse(written, "k")
    assert message in str(info.value)
    # The schema (the chart's, checked before the gateway starts) refuses what it can see;
    # what it cannot (a range in a size, an address's syntax) only the gateway refuses.
    assert _schema_takes(_value(name), written) is not schema_sees


def test_every_value_reader_is_in_the_tables() -> None:
    names = {n for n in dir(v) if isinstance(getattr(v, n), Value)}
    assert names == {r[0] for r in READS} | {r[0] for r in REFUSES}
    assert names == {r[0] for r in READS}  # each with a value it reads, too


def test_optional_takes_null_and_what_its_value_takes() -> None:
    value = v.optional(v.TEXT)
    assert value.parse(None, "k") is None and value.parse("x", "k") == "x"
    with pytest.raises(ConfigError, match=r"^k: expected a non-empty string"):
        value.parse("", "k")
    assert _schema_takes(value, None) and not _schema_takes(value, "")
    assert value.takes == "a non-empty string, or null"


@pytest.mark.parametrize("name", ["MEMORY", "RETAIN"])
def test_a_value_filling_two_fields_says_which(name: str) -> None:
    value = _value(name)
    assert len(value.into) == 2 and len(value.parse(0, "k")) == 2


def _env(name: str) -> Any:
    return _value(name).env_yaml


def test_environment_overrides_read_as_yaml_are_the_typed_values() -> None:
    # numbers, booleans, lists and maps are YAML in SANDBOX_GATEWAY_*; durations, sizes,
    # addresses and names are text (`1:30` must stay a host:port, not YAML's 90)
    assert {n for n in dir(v) if isinstance(getattr(v, n), Value) and _env(n)} == {
        "LEEWAY", "STR_LIST", "STR_MAP", "ANY_MAP", "COUNT", "POSITIVE", "BURST", "RATE",
        "BOOL", "RETAIN", "NETWORKS", "HOST_PATTERNS", "RATIO"}
