"""The admin API over Starlette's TestClient, with a real TokenService and real policies."""

from __future__ import annotations

import base64
import hmac
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jwt
import pytest
from starlette.testclient import TestClient

from gateway.api.admin import AdminContext, build_admin_app
from gateway.core.addresses import AddressPolicy
from gateway.core.policy import PolicySet
from gateway.net.resolver import DestinationGuard, StaticResolver
from gateway.services.identity.signing_keys import SigningKeys
from gateway.services.identity.tokens import TokenRefused, TokenService
from gateway.services.policy import load_policy_texts
from gateway.services.state.base import MemoryState

ADMIN = "admin-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {ADMIN}"}

POLICIES = {
    "agent.yaml": """\
version: v1
name: agent
extends: [base]
egress:
  - host: api.openai.com
    credential: openai
    paths: ["/v1/chat/completions"]
  - host: api.anthropic.com
    credential: anthropic
credentials:
  openai: {preset: openai, secret: openai-api-key}
  anthropic: {preset: anthropic, secret: anthropic-api-key}
""",
    "base.yaml": """\
version: v1
name: base
mode: report
egress:
  - host: pypi.org
""",
}


class Ready:
    def __init__(self) -> None:
        self.ok, self.why = True, "ready"
        self.degrades: list[str] = []

    def ready(self) -> tuple[bool, str]:
        return self.ok, self.why

    def degraded(self) -> list[str]:
        return self.degrades


class Admin:
    def __init__(self, tmp_path: Path) -> None:
        self.policy_set: PolicySet = load_policy_texts(POLICIES)
        self.readiness = Ready()
        self.tokens = TokenService(SigningKeys.load(tmp_path / "signing"), MemoryState(),
                                   self.credentials, max_ttl=3600)
        self.app = build_admin_app(AdminContext(
            admin_token=ADMIN, tokens=self.tokens, policies=lambda: self.policy_set,
            readiness=self.readiness,
        ))

    def credentials(self, name: str) -> list[str] | None:
        policy = self.policy_set.get(name)
        return None if policy is None else sorted({r.credential for r in policy.rules
                                                   if r.credential})


@pytest.fixture
def admin(tmp_path: Path) -> Admin:
    return Admin(tmp_path)


@pytest.fixture
def client(admin: Admin) -> Iterator[TestClient]:
    with TestClient(admin.app) as c:
        yield c


def claims(token: str) -> dict[str, Any]:
    payload = token.split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))))


def assert_error(response: Any, status: int, code: str, *words: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "reason"}
    assert body["error"] == code
    assert response.headers["x-sandbox-gateway-error"] == code
    for word in words:
        assert word in body["reason"]


# --- open endpoints --------------------------------------------------------------------


def test_healthz(client: TestClient) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_readyz(client: TestClient, admin: Admin) -> None:
    assert client.get("/readyz").json() == {"ready": True, "reason": "ready"}
    admin.readiness.ok, admin.readiness.why = False, "policies not loaded"
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json() == {"ready": False, "reason": "policies not loaded"}
    # Serving on without something (the state store away): 200, and it says what.
    admin.readiness.ok, admin.readiness.why = True, "degraded: state store: disk full"
    admin.readiness.degrades = ["state store"]
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json() == {"ready": True, "reason": "degraded: state store: disk full",
                               "degraded": ["state store"]}


def test_metrics(client: TestClient) -> None:
    client.post("/v1/tokens", headers=AUTH, json={"sandbox": "sb", "policy": "agent"})
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert 'sandbox_gateway_tokens_issued_total{kind="mint"}' in response.text


def test_jwks_is_public_and_verifies_minted_tokens(client: TestClient, admin: Admin) -> None:
    response = client.get("/.well-known/jwks.json")
    assert response.status_code == 200
    keys = response.json()["keys"]
    assert [k["kid"] for k in keys] == admin.tokens.keys.active_kids()
    assert all(k["kty"] == "OKP" and k["crv"] == "Ed25519" and "d" not in k for k in keys)
    token = client.post("/v1/tokens", headers=AUTH,
                        json={"sandbox": "sb", "policy": "agent"}).json()["token"]
    jwk = {k["kid"]: k for k in keys}[jwt.get_unverified_header(token)["kid"]]
    decoded = jwt.decode(token, jwt.PyJWK(jwk).key, algorithms=["EdDSA"],
                         audience="sandbox-gateway")
    assert decoded["sub"] == "sb"


# --- authentication --------------------------------------------------------------------

PROTECTED = [
    ("POST", "/v1/tokens", {"sandbox": "sb", "policy": "agent"}),
    ("POST", "/v1/tokens/revoke", {"jti": "x"}),
    ("GET", "/v1/policies", None),
    ("POST", "/v1/explain", {"policy": "agent", "method": "GET", "url": "https://pypi.org/"}),
]
BAD_AUTH: list[dict[str, str]] = [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Bearer {ADMIN}x"},
    {"Authorization": f"Bearer {ADMIN[:-1]}"},
    {"Authorization": ADMIN},
    {"Authorization": f"Basic {ADMIN}"},
    {"Authorization": "Bearer "},
    {"X-Admin-Token": ADMIN},
]


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED, ids=[p[1] for p in PROTECTED])
@pytest.mark.parametrize("headers", BAD_AUTH, ids=range(len(BAD_AUTH)))
def test_protected_routes_refuse_without_the_admin_token(
    client: TestClient, admin: Admin, method: str, path: str, body: Any,
    headers: dict[str, str],
) -> None:
    response = client.request(method, path, headers=headers, json=body)
    assert_error(response, 401, "admin_auth_required", "Authorization: Bearer")
    assert ADMIN not in response.text
    assert not admin.tokens.state.is_revoked("x")


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED, ids=[p[1] for p in PROTECTED])
def test_protected_routes_accept_the_admin_token(client: TestClient, method: str, path: str,
                                                 body: Any) -> None:
    assert client.request(method, path, headers=AUTH, json=body).status_code == 200


def test_token_compared_in_constant_time(client: TestClient,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert client.get("/v1/policies", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.get("/v1/policies", headers=AUTH).status_code == 200
    assert calls == [(b"Bearer nope", f"Bearer {ADMIN}".encode()),
                     (f"Bearer {ADMIN}".encode(), f"Bearer {ADMIN}".encode())]


# --- tokens ----------------------------------------------------------------------------


def test_mint_defaults(client: TestClient, admin: Admin) -> None:
    response = client.post("/v1/tokens", headers=AUTH, json={"sandbox": "sb-1", "policy": "agent"})
    assert response.status_code == 200, response.text
    data = response.json()
    assert set(data) == {"token", "jti", "expires_at"}
    c = claims(data["token"])
    assert c["scope"] == "anthropic openai"           # every credential the policy references
    assert c["exp"] - c["iat"] == 15 * 60
    assert (c["jti"], c["exp"]) == (data["jti"], data["expires_at"])
    identity = admin.tokens.verify(data["token"])
    assert (identity.sandbox, identity.policy, identity.user) == ("sb-1", "agent", None)
    assert "usr" not in c


def test_mint_names_a_user(client: TestClient, admin: Admin) -> None:
    """`user`: the person the sandbox acts for (`usr`), listed with the token."""
    response = client.post("/v1/tokens", headers=AUTH, json={
        "sandbox": "sb-1", "policy": "agent", "user": "alice@example.com"})
    assert response.status_code == 200, response.text
    assert claims(response.json()["token"])["usr"] == "alice@example.com"
    assert admin.tokens.verify(response.json()["token"]).user == "alice@example.com"
    listed = client.get("/v1/tokens", headers=AUTH).json()["tokens"]
    assert [t["user"] for t in listed if t["jti"] == response.json()["jti"]] == \
        ["alice@example.com"]


@pytest.mark.parametrize(
    ("extra", "scope", "ttl"),
    [
        ({"scope": "openai"}, "openai", 900),
        ({"scope": "openai:/v1/chat/completions anthropic"},
         "anthropic openai:/v1/chat/completions", 900),
        ({"scope": ["openai", "anthropic"]}, "anthropic openai", 900),
        ({"scope": ""}, "", 900),
        ({"ttl": "5m"}, "anthropic openai", 300),
        ({"ttl": 60}, "anthropic openai", 60),
        ({"ttl": "1h", "scope": "openai"}, "openai", 3600),
        ({"ttl": None}, "anthropic openai", 900),
    ],
)
def test_mint_scope_and_ttl(client: TestClient, admin: Admin, extra: dict[str, Any],
                            scope: str, ttl: int) -> None:
    response = client.post("/v1/tokens", headers=AUTH,
                           json={"sandbox": "sb", "policy": "agent", **extra})
    assert response.status_code == 200, response.text
    c = claims(response.json()["token"])
    assert c["scope"] == scope
    assert c["exp"] - c["iat"] == ttl
    admin.tokens.verify(response.json()["token"])


MINT_ERRORS: list[tuple[Any, str]] = [
    ({"sandbox": "sb", "policy": "nope"}, "policy 'nope' does not exist"),
    ({"sandbox": "sb", "policy": "agent", "ttl": "2h"}, "longer than tokens.max_ttl"),
    ({"sandbox": "sb", "policy": "agent", "ttl": "soon"}, "ttl: 'soon' is not a duration"),
    ({"sandbox": "sb", "policy": "agent", "ttl": 0}, "ttl: must be positive"),
    ({"sandbox": "sb", "policy": "agent", "ttl": True}, "ttl: expected a duration"),
    ({"sandbox": "sb", "policy": "agent", "scope": 5}, "scope must be"),
    ({"sandbox": "sb", "policy": "agent", "scope": "openai:v1"}, "must start with /"),
    ({"sandbox": "sb bad", "policy": "agent"}, "sandbox id"),
    ({"sandbox": "sb", "policy": "agent", "user": ["alice"]}, "user must be a string"),
    ({"sandbox": "sb", "policy": "agent", "user": "al ice"}, "user must be a person's name"),
    ({"policy": "agent"}, "sandbox and policy are required"),
    ({"sandbox": "sb"}, "sandbox and policy are required"),
    ({"sandbox": 1, "policy": "agent"}, "sandbox and policy are required"),
    ([1, 2], "body must be a JSON object"),
    ("text", "body must be a JSON object"),
]


@pytest.mark.parametrize(("body", "message"), MINT_ERRORS)
def test_mint_errors(client: TestClient, body: Any, message: str) -> None:
    assert_error(client.post("/v1/tokens", headers=AUTH, json=body), 400, "bad_request", message)


@pytest.mark.parametrize("raw", [b"not json", b"{", b"\xff\xfe", b"{'single': 1}"])
@pytest.mark.parametrize("path", ["/v1/tokens", "/v1/tokens/revoke", "/v1/explain"])
def test_non_json_body(client: TestClient, path: str, raw: bytes) -> None:
    response = client.post(path, headers={**AUTH, "Content-Type": "application/json"},
                           content=raw)
    assert_error(response, 400, "bad_request", "JSON")


def test_empty_body_is_an_empty_object(client: TestClient) -> None:
    assert_error(client.post("/v1/tokens", headers=AUTH), 400, "bad_request",
                 "sandbox and policy are required")


def test_revoke(client: TestClient, admin: Admin) -> None:
    minted = client.post("/v1/tokens", headers=AUTH,
                         json={"sandbox": "sb", "policy": "agent"}).json()
    other = client.post("/v1/tokens", headers=AUTH,
                        json={"sandbox": "sb", "policy": "agent"}).json()
    admin.tokens.verify(minted["token"])  # cached as valid first

    response = client.post("/v1/tokens/revoke", headers=AUTH, json={"jti": minted["jti"]})
    assert response.status_code == 200
    assert response.json() == {"revoked": minted["jti"], "workers": 1, "stored": True}
    with pytest.raises(TokenRefused) as info:
        admin.tokens.verify(minted["token"])
    assert info.value.code == "token_revoked"
    admin.tokens.verify(other["token"])


@pytest.mark.parametrize("body", [{}, {"jti": ""}, {"jti": 5}, {"token": "x"}])
def test_revoke_needs_a_jti(client: TestClient, body: dict[str, Any]) -> None:
    assert_error(client.post("/v1/tokens/revoke", headers=AUTH, json=body), 400,
                 "bad_request", "jti is required")


def test_mint_follows_policy_reloads(client: TestClient, admin: Admin) -> None:
    token = client.post("/v1/tokens", headers=AUTH,
                        json={"sandbox": "sb", "policy": "agent"}).json()["token"]
    admin.policy_set = load_policy_texts({"base.yaml": POLICIES["base.yaml"]})
    assert_error(client.post("/v1/tokens", headers=AUTH,
                             json={"sandbox": "sb", "policy": "agent"}),
                 400, "bad_request", "does not exist")
    with pytest.raises(TokenRefused) as info:
        admin.tokens.verify(token)
    assert info.value.code == "unknown_policy"


# --- policies and explain --------------------------------------------------------------


def test_policies(client: TestClient) -> None:
    response = client.get("/v1/policies", headers=AUTH)
    assert response.status_code == 200
    assert response.json()["revision"] == load_policy_texts(POLICIES).revision
    assert response.json()["revision"].startswith("sha256:")
    by_name = {p["name"]: p for p in response.json()["policies"]}
    assert set(by_name) == {"agent", "base"}
    assert by_name["agent"] == {"name": "agent", "mode": "enforce", "source": "agent.yaml",
                                "extends": ["base"], "rules": 3,
                                "credentials": ["anthropic", "openai"], "budgets": []}
    assert by_name["base"]["mode"] == "report"
    assert by_name["base"]["credentials"] == []


EXPLAIN: list[tuple[str, str, str, str, str | None, str | None]] = [
    # policy, method, url -> decision, rule file, credential
    ("agent", "POST", "https://api.openai.com/v1/chat/completions", "allow", "agent.yaml",
     "openai"),
    ("agent", "GET", "api.anthropic.com/v1/messages", "allow", "agent.yaml", "anthropic"),
    ("agent", "GET", "https://pypi.org/simple/", "allow", "base.yaml", None),
    ("agent", "GET", "https://api.openai.com/v1/files", "deny", None, None),
    ("agent", "GET", "https://evil.example/", "deny", None, None),
    ("base", "GET", "https://evil.example/", "report", None, None),
]


@pytest.mark.parametrize(("policy", "method", "url", "decision", "rule", "credential"), EXPLAIN)
def test_explain(client: TestClient, policy: str, method: str, url: str, decision: str,
                 rule: str | None, credential: str | None) -> None:
    response = client.post("/v1/explain", headers=AUTH,
                           json={"policy": policy, "method": method, "url": url})
    assert response.status_code == 200, response.text
    data = response.json()
    assert set(data) == {"decision", "reason", "error", "rule", "credential", "inspect",
                         "models", "metered", "ask"}
    assert data["ask"] is None  # (no ask: in these policies)
    assert data["decision"] == decision
    assert data["error"] == ("policy_denied" if decision == "deny" else None)
    assert data["reason"]
    assert data["credential"] == credential
    if rule is not None:
        assert data["rule"].startswith(rule + ":")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"policy": "nope", "method": "GET", "url": "https://pypi.org/"}, "unknown policy"),
        ({"policy": "agent", "method": "GET", "url": "ftp://pypi.org/"}, "unsupported URL"),
        ({"policy": "agent", "method": "GET"}, "required strings"),
        ({"policy": "agent", "method": 1, "url": "https://pypi.org/"}, "required strings"),
    ],
)
def test_explain_errors(client: TestClient, body: dict[str, Any], message: str) -> None:
    assert_error(client.post("/v1/explain", headers=AUTH, json=body), 400, "bad_request",
                 message)


class RecordingResolver(StaticResolver):
    """Names mapped to loopback / documentation addresses; records every lookup."""

    def __init__(self) -> None:
        super().__init__({"pypi.org": ["203.0.113.80"], "api.openai.com": ["192.0.2.10"],
                          "api.anthropic.com": ["127.0.0.2"]})
        self.asked: list[str] = []

    async def resolve(self, host: str, port: int) -> list[str]:
        self.asked.append(host)
        return await super().resolve(host, port)


def resolving_app(admin: Admin, guard: DestinationGuard | None, readiness: Any = None
                  ) -> TestClient:
    return TestClient(build_admin_app(AdminContext(
        admin_token=ADMIN, tokens=admin.tokens, policies=lambda: admin.policy_set,
        readiness=readiness or admin.readiness,
        guard=(lambda: guard) if guard is not None else None)))


RESOLVE: list[tuple[str, str, str, str | None, str, str | None]] = [
    # policy, url -> decision, error, policy decision, address class
    ("agent", "https://pypi.org/simple/", "deny", "forbidden_destination", "allow",
     "deny_not_global_unicast"),                                 # TEST-NET-3
    ("agent", "https://api.openai.com/v1/chat/completions", "allow", None, "allow",
     "allow_user_configured"),                                   # opened by allow_cidrs
    ("agent", "https://api.anthropic.com/v1/messages", "deny", "forbidden_destination",
     "allow", "deny_not_global_unicast"),                        # loopback
    ("base", "https://nowhere.test/", "deny", "unresolvable", "report", None),
    ("agent", "https://api.openai.com:8443/", "deny", "policy_denied", "deny", None),
]


@pytest.mark.parametrize(("policy", "url", "decision", "error", "policy_decision", "cls"),
                         RESOLVE)
def test_explain_resolve(admin: Admin, policy: str, url: str, decision: str,
                         error: str | None, policy_decision: str, cls: str | None) -> None:
    resolver = RecordingResolver()
    guard = DestinationGuard(AddressPolicy(allow_cidrs=["192.0.2.0/24"]), resolver)
    with resolving_app(admin, guard) as client:
        data = client.post("/v1/explain", headers=AUTH, json={
            "policy": policy, "method": "POST", "url": url, "resolve": True}).json()
    assert (data["decision"], data["error"], data["policy_decision"]) == (
        decision, error, policy_decision)
    if policy_decision == "deny":  # the gateway never resolves a host the policy denies
        assert data["destination"] is None and resolver.asked == []
        return
    destination = data["destination"]
    assert destination["class"] == cls and destination["error"] == error
    assert resolver.asked == [url.split("/")[2].split(":")[0]]
    if decision == "deny":
        assert data["reason"] == destination["reason"]
    else:
        assert destination["address"] == "192.0.2.10 port 443"


def test_explain_resolve_with_the_gateways_guard_and_errors(admin: Admin) -> None:
    guard = DestinationGuard(AddressPolicy(), RecordingResolver(),
                             overrides={"pypi.org": ("127.0.0.1", 8443)})
    body = {"policy": "agent", "method": "GET", "url": "https://pypi.org/", "resolve": True}
    with resolving_app(admin, guard) as client:  # app.py passes the gateway's guard
        data = client.post("/v1/explain", headers=AUTH, json=body).json()
        assert data["decision"] == "allow"
        assert data["destination"]["trusted"] is True
        assert data["destination"]["address"] == "127.0.0.1 port 8443"
        assert_error(client.post("/v1/explain", headers=AUTH, json={**body, "resolve": "yes"}),
                     400, "bad_request", "resolve must be true or false")
    with resolving_app(admin, None) as client:
        assert_error(client.post("/v1/explain", headers=AUTH, json=body), 503,
                     "resolve_unavailable")


def test_expires_at_is_in_the_future(client: TestClient) -> None:
    data = client.post("/v1/tokens", headers=AUTH,
                       json={"sandbox": "sb", "policy": "agent"}).json()
    assert time.time() < data["expires_at"] <= time.time() + 900
