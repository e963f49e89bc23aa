"""`network.upstream_proxy` parsing and no_proxy matching (gateway/net/proxy_settings.py)."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, load_config
from gateway.net.proxy_settings import parse_no_proxy, parse_proxy_url, parse_settings

URLS = [
    ("http://proxy.corp:3128", ("http", "proxy.corp", 3128, None)),
    ("http://proxy.corp", ("http", "proxy.corp", 80, None)),
    ("https://Proxy.Corp", ("https", "proxy.corp", 443, None)),
    ("socks5://10.0.0.5", ("socks5", "10.0.0.5", 1080, None)),
    ("http://[fd00::1]:8080", ("http", "fd00::1", 8080, None)),
    ("http://us%40r:p%3Ass@proxy:3128", ("http", "proxy", 3128, "us@r:p:ss")),
]
BAD_URLS = ["ftp://proxy:21", "proxy.corp:3128", "http://", "http://proxy:99999",
            "http://proxy:3128/path", "socks4://proxy"]


@pytest.mark.parametrize(("url", "want"), URLS)
def test_proxy_urls(url: str, want: tuple[str, str, int, str | None]) -> None:
    assert parse_proxy_url(url, "k") == want


@pytest.mark.parametrize("url", BAD_URLS)
def test_bad_proxy_urls(url: str) -> None:
    with pytest.raises(ValueError, match=r"^k"):
        parse_proxy_url(url, "k")


NO_PROXY = ["internal.corp", ".svc.cluster.local", "*.example.org", "10.0.0.0/8", "fd00::/8",
            "192.168.1.7", "git.corp:22"]
MATCHES = [
    ("internal.corp", None, 443, True),
    ("sub.internal.corp", None, 443, False),  # an exact name is only that name
    ("svc.cluster.local", None, 443, True),  # a suffix covers the name itself
    ("api.ns.svc.cluster.local", None, 443, True),
    ("example.org", None, 443, True),
    ("a.example.org", None, 443, True),
    ("notexample.org", None, 443, False),
    ("api.openai.com", "10.1.2.3", 443, True),  # by the checked address
    ("api.openai.com", "11.1.2.3", 443, False),
    ("10.9.9.9", None, 443, True),  # an IP literal destination
    ("v6.test", "fd00::5", 443, True),
    ("192.168.1.7", None, 80, True),
    ("git.corp", None, 22, True),
    ("git.corp", None, 443, False),  # a ported entry: that port only
    ("169.254.169.254", None, 80, True),  # link-local (the metadata service): direct
    ("metadata.test", "169.254.169.254", 80, True),
    ("v6ll.test", "fe80::1", 443, True),
    ("api.test", "169.255.0.1", 443, False),
]


@pytest.mark.parametrize(("host", "ip", "port", "direct"), MATCHES)
def test_no_proxy_matching(host: str, ip: str | None, port: int, direct: bool) -> None:
    assert parse_no_proxy(NO_PROXY, "k").matches(host, ip, port) is direct


def test_no_proxy_star_and_comma_string() -> None:
    assert parse_no_proxy("*", "k").matches("anything.test", None, 1)
    rules = parse_no_proxy(" localhost , .corp,,", "k")
    assert rules.matches("localhost", None, 1) and rules.matches("a.corp", None, 1)
    assert not rules.matches("a.test", None, 1)
    with pytest.raises(ValueError, match="not a name"):
        parse_no_proxy(["bad host!"], "k")


SETTINGS_ERRORS = [
    ({}, "url: required"),
    ({"url": "http://u:p@proxy:1"}, "carries credentials"),
    ({"url": "http://proxy:1", "connect_to": "ip"}, "connect_to"),
    ({"url": "http://proxy:1", "check_ready": "yes"}, "check_ready"),
    ({"url": "http://proxy:1", "credentials": ""}, "credentials"),
    ({"url": "http://proxy:1", "user": "x"}, "unknown key"),
]


@pytest.mark.parametrize(("raw", "message"), SETTINGS_ERRORS)
def test_settings_errors(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_settings(raw, "network.upstream_proxy")


def test_config_and_env_overrides() -> None:
    cfg = load_config(None, env={
        "SANDBOX_GATEWAY_NETWORK__UPSTREAM_PROXY__URL": "socks5://proxy.corp:1080",
        "SANDBOX_GATEWAY_NETWORK__UPSTREAM_PROXY__CREDENTIALS": "corp-proxy",
        "SANDBOX_GATEWAY_NETWORK__UPSTREAM_PROXY__NO_PROXY": ".corp,10.0.0.0/8",
        "SANDBOX_GATEWAY_NETWORK__UPSTREAM_PROXY__CHECK_READY": "true",
        "HTTPS_PROXY": "http://ignored:3128"})
    proxy = cfg.network.upstream_proxy
    assert proxy is not None
    assert (proxy.scheme, proxy.host, proxy.port, proxy.credentials, proxy.connect_to,
            proxy.check_ready) == ("socks5", "proxy.corp", 1080, "corp-proxy", "address", True)
    assert proxy.no_proxy.matches("x.corp", None, 443)


def test_the_process_environment_is_read_only_when_asked() -> None:
    env = {"HTTPS_PROXY": "http://user:s3cret-pass@proxy.corp:3128", "NO_PROXY": ".corp"}
    assert load_config(None, env=env).network.upstream_proxy is None
    cfg = load_config(None, env={**env, "SANDBOX_GATEWAY_NETWORK__UPSTREAM_PROXY": "env"})
    proxy = cfg.network.upstream_proxy
    assert proxy is not None and proxy.source == "env" and proxy.host == "proxy.corp"
    assert proxy.userinfo is not None and proxy.userinfo.reveal() == "user:s3cret-pass"
    assert "s3cret" not in repr(cfg)
    assert proxy.no_proxy.matches("a.corp", None, 443)
    lower = load_config(None, env={"http_proxy": "proxy.corp:8080",
                                   "SANDBOX_GATEWAY_NETWORK__UPSTREAM_PROXY": "env"})
    assert lower.network.upstream_proxy is not None
    assert lower.network.upstream_proxy.where == "http://proxy.corp:8080"
    with pytest.raises(ConfigError, match="HTTPS_PROXY"):
        load_config(None, env={"HTTPS_PROXY": "ftp://x",
                               "SANDBOX_GATEWAY_NETWORK__UPSTREAM_PROXY": "env"})


def test_config_check_warns_about_connect_to_name() -> None:
    from gateway.tools.config_check import config_warnings

    base = {"SANDBOX_GATEWAY_NETWORK__UPSTREAM_PROXY__URL": "http://proxy.corp:3128",
            "SANDBOX_GATEWAY_LISTEN__PROXY": "127.0.0.1:8080"}  # (on every interface: a warning)
    assert config_warnings(load_config(None, env=base)) == []
    named = load_config(None, env={
        **base, "SANDBOX_GATEWAY_NETWORK__UPSTREAM_PROXY__CONNECT_TO": "name"})
    (warning,) = config_warnings(named)
    assert warning.startswith("network.upstream_proxy.connect_to: name")
