"""The sandbox environment: proxy URL with sandbox id and token, CA bundle, API-key variables."""

from __future__ import annotations

import base64
import json
from urllib.parse import unquote, urlsplit

import pytest

from gateway.sandbox_env import (
    API_KEY_VARIABLES,
    CA_VARIABLES,
    dns_note,
    proxy_url,
    sandbox_env,
)

JWT = "eyJhbGciOiJFZERTQSJ9." + base64.urlsafe_b64encode(
    json.dumps({"sub": "sb-42", "pol": "agent"}).encode()).rstrip(b"=").decode() + ".c2ln"


@pytest.mark.parametrize(
    ("proxy", "sandbox", "token", "expected"),
    [
        ("http://gateway:8080", "sb", "T", "http://sb:T@gateway:8080"),
        ("gateway:8080", "sb", "T", "http://sb:T@gateway:8080"),
        ("http://gateway", "sb", "T", "http://sb:T@gateway"),
        ("http://gateway:8080/", "sb", "T", "http://sb:T@gateway:8080"),
        ("http://Gateway.NS.svc:3128", "sb", "T", "http://sb:T@gateway.ns.svc:3128"),
        ("http://[fd00::1]:8080", "sb", "T", "http://sb:T@[fd00::1]:8080"),
        ("https://gateway:8443", "sb", "T", "https://sb:T@gateway:8443"),
        ("http://old:creds@gateway:8080", "sb", "T", "http://sb:T@gateway:8080"),
        ("http://gateway:8080", "a b", "t/k:n@", "http://a%20b:t%2Fk%3An%40@gateway:8080"),
        ("http://gateway:8080", "sb", "aaa.bb-b_.c~c", "http://sb:aaa.bb-b_.c~c@gateway:8080"),
    ],
)
def test_proxy_url(proxy: str, sandbox: str, token: str, expected: str) -> None:
    url = proxy_url(proxy, sandbox, token)
    assert url == expected
    parts = urlsplit(url)
    assert (unquote(parts.username or ""), unquote(parts.password or "")) == (sandbox, token)


def _env(lines: list[str]) -> dict[str, str]:
    env = dict(line.split("=", 1) for line in lines)
    assert len(env) == len(lines)  # no variable twice
    return env


def test_sandbox_env_contract() -> None:
    env = _env(sandbox_env(JWT, "http://gateway:8080"))
    url = f"http://sb-42:{JWT}@gateway:8080"
    assert env["HTTPS_PROXY"] == env["HTTP_PROXY"] == url
    assert env["https_proxy"] == env["http_proxy"] == url
    for var in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", *CA_VARIABLES):
        assert env[var] == "/etc/sandbox-gateway/ca-bundle.pem"
    for var in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", *API_KEY_VARIABLES):
        assert env[var] == JWT  # the token, never a key
    assert "localhost" in env["NO_PROXY"]


@pytest.mark.parametrize(
    ("token", "sandbox", "expected"),
    [
        (JWT, None, "sb-42"),            # from the token's sub
        (JWT, "explicit", "explicit"),   # --sandbox wins
        ("opaque", None, "sandbox"),     # not a JWT: a placeholder user
        ("a.MTIz.b", None, "sandbox"),   # a JWT-looking token whose payload is not an object
    ],
)
def test_sandbox_id(token: str, sandbox: str | None, expected: str) -> None:
    env = _env(sandbox_env(token, "gateway:8080", sandbox=sandbox))
    assert urlsplit(env["HTTPS_PROXY"]).username == expected


def test_ca_bundle_path() -> None:
    env = _env(sandbox_env("T", "gateway:8080", ca_bundle="/opt/ca.pem"))
    assert {env[v] for v in CA_VARIABLES} == {"/opt/ca.pem"}


@pytest.mark.parametrize(
    ("proxy", "name_hint"),
    [("http://gateway.egress.svc:8080", True), ("http://10.96.0.20:8080", False),
     ("http://[fd00::20]:8080", False), ("gateway:3128", True)],
)
def test_dns_note_says_no_resolver_is_needed(proxy: str, name_hint: bool) -> None:
    note = "\n".join(dns_note(proxy))
    assert all(line.startswith("# ") for line in dns_note(proxy))  # comments, if pasted
    assert "needs no resolver" in note and "dnsPolicy: None" in note
    assert ("is a name" in note) is name_hint
    if name_hint:
        assert "hostAliases" in note
