"""The credential swap: carriers, scope, TLS only, and finding a token in a request."""

from __future__ import annotations

import base64
import dataclasses

import pytest

from gateway.core import credentials
from gateway.core.messages import Headers
from gateway.core.policy import Credential, Injection
from gateway.core.refusal import Refusal
from gateway.core.secret_value import SecretValue
from gateway.core.target import Target
from gateway.services.identity.signing_keys import SigningKeys
from gateway.services.identity.tokens import TokenService
from gateway.services.state.base import MemoryState

OPENAI = Credential(name="openai", secret="k", hosts=("api.openai.com",),
                    injection=Injection("bearer"), preset="openai")
ANTHROPIC = Credential(name="anthropic", secret="k", hosts=("api.anthropic.com",),
                       injection=Injection("header", "x-api-key",
                                           alternatives=(Injection("bearer"),)))
GEMINI = Credential(name="gemini", secret="k", hosts=("generativelanguage.googleapis.com",),
                    injection=Injection("header", "x-goog-api-key",
                                        alternatives=(Injection("query", "key"),)))
BASIC = Credential(name="git", secret="k", hosts=("git.example.com",),
                   injection=Injection("basic", "x-access-token"))
SHAPED = Credential(name="anthropic", secret="k", hosts=("api.anthropic.com",),
                    injection=Injection("header", "x-api-key"), preset="anthropic",
                    placeholder="sk-ant-api03-")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> TokenService:
    keys = SigningKeys.load(tmp_path_factory.mktemp("keys"))
    names = {"agent": ["openai", "anthropic", "gemini", "git"], "narrow": ["openai"]}
    return TokenService(keys, MemoryState(), names.get)


def _target(host: str, path: str = "/v1/x", scheme: str = "https") -> Target:
    return Target(scheme, host, 443 if scheme == "https" else 80, path)


@pytest.mark.parametrize(("credential", "host", "carry", "check"), [
    (OPENAI, "api.openai.com", lambda t: ([("Authorization", f"Bearer {t}")], "/v1/x"),
     lambda h, p: h.get("authorization") == "Bearer REAL"),
    (ANTHROPIC, "api.anthropic.com", lambda t: ([("x-api-key", t)], "/v1/x"),
     lambda h, p: h.get("x-api-key") == "REAL" and h.get("authorization") is None),
    (ANTHROPIC, "api.anthropic.com", lambda t: ([("Authorization", f"Bearer {t}")], "/v1/x"),
     lambda h, p: h.get("authorization") == "Bearer REAL" and h.get("x-api-key") is None),
    (GEMINI, "generativelanguage.googleapis.com", lambda t: ([], f"/v1/m?alt=sse&key={t}"),
     lambda h, p: p == "/v1/m?alt=sse&key=REAL"),
    # a key-shaped token (the credential's placeholder before it): stripped, then checked
    (SHAPED, "api.anthropic.com", lambda t: ([("x-api-key", f"sk-ant-api03-{t}")], "/v1/x"),
     lambda h, p: h.get("x-api-key") == "REAL"),
    (SHAPED, "api.anthropic.com", lambda t: ([("x-api-key", t)], "/v1/x"),  # or without it
     lambda h, p: h.get("x-api-key") == "REAL"),
    (BASIC, "git.example.com",
     lambda t: ([("Authorization", "Basic " + base64.b64encode(f"u:{t}".encode()).decode())],
                "/repo.git/info/refs"),
     lambda h, p: base64.b64decode(h.get("authorization").split()[1]) == b"x-access-token:REAL"),
])
def test_swap_in_the_carrier_the_client_used(service: TokenService, credential: Credential,
                                             host: str, carry: object, check: object) -> None:
    token = service.mint("s1", "agent").token
    fields, path = carry(token)  # type: ignore[operator]
    headers = Headers.of(*fields)
    identity = service.verify(token)
    swap, path = credentials.plan(credential, headers, _target(host, path), identity,
                                  service.verify, "p.yaml:3")
    path = credentials.apply(swap, headers, path, "REAL")
    assert check(headers, path)  # type: ignore[operator]
    assert token not in repr(headers.fields) and token not in path


def test_cleartext_is_refused_before_anything_else(service: TokenService) -> None:
    """Finding 1: a key never travels over http://."""
    token = service.mint("s1", "agent").token
    headers = Headers.of(("Authorization", f"Bearer {token}"))
    with pytest.raises(Refusal) as info:
        credentials.plan(OPENAI, headers, _target("api.openai.com", scheme="http"),
                         service.verify(token), service.verify, "p.yaml:3")
    assert info.value.code == "credential_requires_tls" and "https://" in info.value.reason


@pytest.mark.parametrize(("policy", "sandbox", "headers", "code"), [
    ("agent", "s1", [], "credential_not_in_scope"),
    ("narrow", "s1", None, "credential_not_in_scope"),  # scope lacks anthropic
    ("agent", "other", None, "credential_not_in_scope"),  # another sandbox's token
])
def test_refused_swaps(service: TokenService, policy: str, sandbox: str,
                       headers: list[tuple[str, str]] | None, code: str) -> None:
    own = service.mint("s1", "agent").token
    carried = service.mint(sandbox, policy).token
    fields = headers if headers is not None else [("x-api-key", carried)]
    with pytest.raises(Refusal) as info:
        credentials.plan(ANTHROPIC, Headers.of(*fields), _target("api.anthropic.com"),
                         service.verify(own), service.verify, "p.yaml:3")
    assert info.value.code == code


def test_find_token_in_carriers(service: TokenService) -> None:
    token = service.mint("s1", "agent").token
    basic = "Basic " + base64.b64encode(f"x:{token}".encode()).decode()
    for headers, path in [([("x-api-key", token)], "/"), ([("Authorization", basic)], "/"),
                          ([], f"/m?key={token}")]:
        assert credentials.find_token(Headers.of(*headers), path) == token
    assert credentials.find_token(Headers.of(("Authorization", "Bearer abc")), "/") is None
    shaped = Headers.of(("x-api-key", f"sk-ant-api03-{token}"))  # (after a placeholder)
    assert credentials.find_token(shaped, "/") == token


def test_a_placeholder_is_no_token(service: TokenService) -> None:
    """Only a verified token follows the placeholder: the prefix alone, or another
    sandbox's token behind it, is refused like any other carrier value."""
    token = service.mint("s1", "agent").token
    identity = service.verify(token)
    for value, code in [("sk-ant-api03-", "token_malformed"),
                        (f"sk-ant-api03-{service.mint('s2', 'agent').token}",
                         "credential_not_in_scope")]:
        with pytest.raises(Refusal) as caught:
            credentials.plan(SHAPED, Headers.of(("x-api-key", value)),
                             _target("api.anthropic.com"), identity, service.verify, None)
        assert caught.value.code == code


AZURE = Credential(name="azure", secret="k", hosts=("res.openai.azure.com",),
                   injection=Injection("header", "api-key"), preset="azure-openai")
ALIAS, SECRET = "ek_0123456789abcdef0123456789abcdef", "ek_the_provider_minted_this_00"
WS = [("Upgrade", "websocket"), ("Connection", "Upgrade")]


@pytest.mark.parametrize(("credential", "host", "fields", "path", "check"), [
    (OPENAI, "api.openai.com", [("Authorization", f"Bearer {ALIAS}")], "/v1/realtime",
     lambda h, p: h.get("authorization") == f"Bearer {SECRET}"),
    (AZURE, "res.openai.azure.com", [("api-key", ALIAS)], "/openai/realtime",
     lambda h, p: h.get("api-key") == SECRET and h.get("authorization") is None),
    (AZURE, "res.openai.azure.com", [("Authorization", f"Bearer {ALIAS}")],
     "/openai/realtime", lambda h, p: h.get("authorization") == f"Bearer {SECRET}"),
    (GEMINI, "generativelanguage.googleapis.com", [("x-goog-api-key", ALIAS)], "/v1/m",
     lambda h, p: h.get("x-goog-api-key") == SECRET and p == "/v1/m"),
    (GEMINI, "generativelanguage.googleapis.com", [], f"/v1/m?alt=sse&key={ALIAS}",
     lambda h, p: p == f"/v1/m?alt=sse&key={SECRET}"),
    (GEMINI, "generativelanguage.googleapis.com", [], f"/ws/Live?access_token={ALIAS}",
     lambda h, p: p == f"/ws/Live?access_token={SECRET}"),
    # a browser's WebSocket: the key as a subprotocol; the others offered are kept
    (OPENAI, "api.openai.com", [*WS, ("Sec-WebSocket-Protocol",
                                      f"realtime, openai-insecure-api-key.{ALIAS}, "
                                      "openai-beta.realtime-v1")], "/v1/realtime",
     lambda h, p: h.get("sec-websocket-protocol") == "realtime, openai-beta.realtime-v1, "
     f"openai-insecure-api-key.{SECRET}" and h.get("authorization") is None),
])
def test_a_minted_secret_replaces_its_alias_in_the_carrier_it_came_in(
        service: TokenService, credential: Credential, host: str,
        fields: list[tuple[str, str]], path: str, check: object) -> None:
    """On a rule with allow_minted_secrets a carrier may hold the alias of a secret the
    provider minted for this sandbox with this credential: the alias is taken out of
    the head (every carrier emptied before the leak scan) and the secret goes where it
    was, as a key would."""
    identity = service.verify(service.mint("s1", "agent").token)
    secret = SecretValue(SECRET)
    asked: list[str] = []

    def find(value: str) -> SecretValue | None:
        asked.append(value)
        return secret if value == ALIAS else None

    headers = Headers.of(*fields)
    swap, planned = credentials.plan(credential, headers, _target(host, path), identity,
                                     service.verify, "p.yaml:3", find)
    assert swap.minted is secret and asked[-1] == ALIAS
    assert ALIAS not in repr(headers.fields) and ALIAS not in planned  # (then scanned)
    placed = credentials.apply(swap, headers, planned, secret.reveal())
    assert check(headers, placed)  # type: ignore[operator]
    assert ALIAS not in repr(headers.fields) and ALIAS not in placed


def test_what_is_no_alias_is_checked_as_a_token(service: TokenService) -> None:
    """A value that is no alias of this sandbox's goes on to the token check (refused);
    a finder's own refusal (another sandbox's alias) stands; a gateway token is never
    looked up as an alias; cleartext is refused before any carrier is read."""
    token = service.mint("s1", "agent").token
    identity = service.verify(token)
    asked: list[str] = []
    foreign = "ek_of_another_sandbox_000"

    def find(value: str) -> SecretValue | None:
        asked.append(value)
        if value == foreign:
            raise Refusal("exfiltration_blocked", "another sandbox's alias")
        return None

    for finder in (find, None):
        with pytest.raises(Refusal) as refused:
            credentials.plan(OPENAI, Headers.of(("Authorization", "Bearer ek_other_value")),
                             _target("api.openai.com"), identity, service.verify, "p.yaml:3",
                             finder)
        assert refused.value.code.startswith("token_")
    with pytest.raises(Refusal) as refused:
        credentials.plan(OPENAI, Headers.of(("Authorization", f"Bearer {foreign}")),
                         _target("api.openai.com"), identity, service.verify, "p.yaml:3", find)
    assert refused.value.code == "exfiltration_blocked"
    asked.clear()
    swap, _ = credentials.plan(OPENAI, Headers.of(("Authorization", f"Bearer {token}")),
                               _target("api.openai.com"), identity, service.verify,
                               "p.yaml:3", find)
    assert swap.minted is None and token not in asked
    with pytest.raises(Refusal) as refused:
        credentials.plan(OPENAI, Headers.of(("Authorization", f"Bearer {ALIAS}")),
                         _target("api.openai.com", scheme="http"), identity, service.verify,
                         "p.yaml:3", lambda v: SecretValue(SECRET))
    assert refused.value.code == "credential_requires_tls"


@pytest.mark.parametrize(("hosts", "host", "bound"), [
    (("api.openai.com",), "api.openai.com", True),
    (("api.openai.com",), "API.openai.com", False),  # (hosts arrive normalised)
    (("api.openai.com",), "evil.api.openai.com", False),
    (("api.openai.com",), "api.openai.com.evil", False),
    (("*.example.com",), "a.example.com", True),
    (("*.example.com",), "example.com", False),
    (("*.example.com",), "a.b.example.com", True),  # (any depth: docs/policies.md)
    (("**.example.com",), "a.b.example.com", True),
    (("**.example.com",), "example.com", True),
    (("git-*.example.com",), "git-eu.example.com", True),
    (("git-*.example.com",), "git-eu.x.example.com", False),
    (("10.0.0.1",), "10.0.0.1", True),
    (("10.0.0.1",), "10.0.0.2", False),
    (("a.test", "*.b.test", "c.test"), "c.test", True),
    (("a.test", "*.b.test", "c.test"), "x.b.test", True),
    (("a.test", "*.b.test", "c.test"), "b.test", False),
])
def test_a_credential_binds_exactly_its_hosts(hosts: tuple[str, ...], host: str,
                                               bound: bool) -> None:
    """`Credential.binds` (asked twice a credential call) for exact, wildcard and IP
    hosts, mixed; `static_refusal` refuses what it does not bind, and a copy with other
    hosts binds those."""
    cred = Credential(name="c", secret="k", hosts=hosts, injection=Injection("bearer"))
    assert cred.binds(host) is bound
    refusal = credentials.static_refusal(cred, "https", host, "p.yaml:1")
    assert (refusal is None) is bound
    other = dataclasses.replace(cred, hosts=("only.test",), host_patterns=())
    assert other.binds("only.test") and (not other.binds(host) or host == "only.test")
