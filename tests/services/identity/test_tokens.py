"""Sandbox tokens: mint/verify round trip, every refusal code, rotation, JWKS, refresh, cache."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization

from gateway.services.identity.claims import (
    TokenError,
    format_scope,
    parse_scope,
    unverified_claims,
)
from gateway.services.identity.signing_keys import SigningKeys
from gateway.services.identity.tokens import AUDIENCE, Identity, TokenRefused, TokenService
from gateway.services.state.base import MemoryState

T0 = 1_700_000_000.0  # in the past, so nothing depends on the real clock by accident


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def b64(data: bytes | dict[str, Any]) -> str:
    raw = json.dumps(data).encode() if isinstance(data, dict) else data
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def b64decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def header_of(token: str) -> dict[str, Any]:
    return dict(json.loads(b64decode(token.split(".")[0])))


def claims_of(token: str) -> dict[str, Any]:
    return dict(json.loads(b64decode(token.split(".")[1])))


class Env:
    """A token service over a temporary key directory, a fake clock and a policy set."""

    def __init__(self, directory: Path, **kwargs: Any) -> None:
        self.directory = directory
        self.clock: Clock = kwargs.pop("clock", Clock())
        self.state = MemoryState()
        self.policies: dict[str, list[str]] = {"agent": ["anthropic", "openai"], "other": []}
        self.keys = SigningKeys.load(directory)
        self.service = self.make(self.keys, **kwargs)

    def make(self, keys: SigningKeys, **kwargs: Any) -> TokenService:
        return TokenService(keys, self.state, self.policies.get, clock=self.clock, **kwargs)

    def claims(self, **over: Any) -> dict[str, Any]:
        now = int(self.clock())
        claims: dict[str, Any] = {
            "iss": "sandbox-gateway", "aud": AUDIENCE, "sub": "sb-1", "pol": "agent",
            "scope": "openai", "iat": now, "nbf": now, "exp": now + 900, "jti": "j1",
            "lim": now + 3600,
        }
        claims.update(over)
        return {k: v for k, v in claims.items() if v is not None}

    def sign(self, claims: dict[str, Any], kid: str | None = None) -> str:
        kid = kid or self.keys.signing_kid
        return jwt.encode(claims, self.keys.private[kid], algorithm="EdDSA",
                          headers={"kid": kid})


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return Env(tmp_path / "signing")


def refused(service: TokenService, token: str) -> TokenRefused:
    with pytest.raises(TokenRefused) as info:
        service.verify(token)
    return info.value


# --- round trip ------------------------------------------------------------------------


def test_mint_verify_round_trip(env: Env) -> None:
    minted = env.service.mint("sb-1", "agent", parse_scope("openai anthropic:/v1/messages"),
                              ttl=600)
    header, claims = header_of(minted.token), claims_of(minted.token)
    assert header["alg"] == "EdDSA"
    assert header["kid"] == env.keys.signing_kid
    assert set(claims) == {"iss", "aud", "sub", "pol", "scope", "iat", "nbf", "exp", "jti", "lim",
                           "fam"}
    assert claims["fam"] == claims["jti"]  # a fresh mint starts its own refresh chain
    assert claims["iss"] == "sandbox-gateway"
    assert claims["aud"] == "sandbox-gateway"
    assert (claims["sub"], claims["pol"]) == ("sb-1", "agent")
    assert claims["scope"] == "anthropic:/v1/messages openai"
    assert claims["iat"] == claims["nbf"] == int(T0)
    assert claims["exp"] == int(T0) + 600
    assert claims["jti"] == minted.jti
    assert claims["lim"] >= claims["exp"]
    assert minted.expires_at == claims["exp"]

    identity = env.service.verify(minted.token)
    assert identity == Identity(
        sandbox="sb-1", policy="agent", jti=minted.jti,
        scope={"openai": None, "anthropic": frozenset({"/v1/messages"})},
        issued_at=T0, expires_at=T0 + 600, lifetime_end=float(claims["lim"]),
        family=minted.jti,
    )


def test_default_scope_is_every_credential_of_the_policy(env: Env) -> None:
    assert claims_of(env.service.mint("sb-1", "agent").token)["scope"] == "anthropic openai"
    assert claims_of(env.service.mint("sb-1", "other").token)["scope"] == ""
    assert claims_of(env.service.mint("sb-1", "agent", {}).token)["scope"] == ""
    identity = env.service.verify(env.service.mint("sb-1", "other").token)
    assert identity.scope == {}
    assert not identity.allows_credential("openai", "/")


def test_jtis_are_unique(env: Env) -> None:
    assert len({env.service.mint("sb-1", "agent").jti for _ in range(20)}) == 20


def test_valid_at_every_second_of_its_life(env: Env) -> None:
    minted = env.service.mint("sb-1", "agent", ttl=60)
    for offset in (0, 1, 30, 59):
        env.clock.now = T0 + offset
        env.service.verify(minted.token)
    env.clock.now = T0 + 60
    assert refused(env.service, minted.token).code == "token_expired"


# --- refusals --------------------------------------------------------------------------


def _alg_none(env: Env) -> str:
    return f"{b64({'alg': 'none', 'kid': env.keys.signing_kid, 'typ': 'JWT'})}." \
           f"{b64(env.claims())}."


def _hs256_with(secret: bytes) -> Callable[[Env], str]:
    """The key-confusion attack: HMAC-sign with the (public) verification key as secret."""

    def craft(env: Env) -> str:
        header = {"alg": "HS256", "typ": "JWT", "kid": env.keys.signing_kid}
        signing_input = f"{b64(header)}.{b64(env.claims())}".encode()
        key = env.keys.private[env.keys.signing_kid].public_key()
        if secret == b"pem":
            material = key.public_bytes(serialization.Encoding.PEM,
                                        serialization.PublicFormat.SubjectPublicKeyInfo)
        else:
            material = key.public_bytes(serialization.Encoding.Raw,
                                        serialization.PublicFormat.Raw)
        sig = hmac.new(material, signing_input, hashlib.sha256).digest()
        return f"{signing_input.decode()}.{b64(sig)}"

    return craft


def _hs256_with_eddsa_header(env: Env) -> str:
    """Claim EdDSA in the header but carry an HMAC signature: the signature fails."""
    header = {"alg": "EdDSA", "typ": "JWT", "kid": env.keys.signing_kid}
    signing_input = f"{b64(header)}.{b64(env.claims())}".encode()
    raw = env.keys.private[env.keys.signing_kid].public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return f"{signing_input.decode()}.{b64(hmac.new(raw, signing_input, 'sha256').digest())}"


def _foreign_key(env: Env) -> str:
    other = Env(env.directory.parent / "foreign")
    return other.sign(env.claims())


def _no_kid(env: Env) -> str:
    return jwt.encode(env.claims(), env.keys.private[env.keys.signing_kid], algorithm="EdDSA")


def _tampered(env: Env) -> str:
    header, _, sig = env.sign(env.claims()).split(".")
    return f"{header}.{b64(env.claims(sub='someone-else', pol='other'))}.{sig}"


def _bad_sig(env: Env) -> str:
    header, payload, sig = env.sign(env.claims()).split(".")
    flipped = bytearray(b64decode(sig))
    flipped[0] ^= 1
    return f"{header}.{payload}.{b64(bytes(flipped))}"


def _missing(claim: str) -> Callable[[Env], str]:
    return lambda env: env.sign(env.claims(**{claim: None}))


REFUSALS: list[tuple[str, Callable[[Env], str], str, str]] = [
    # (id, craft token, code, what the reason must tell a person to do)
    ("alg-none", _alg_none, "token_bad_algorithm", "mint"),
    ("hs256-pem-public-key", _hs256_with(b"pem"), "token_bad_algorithm", "mint"),
    ("hs256-raw-public-key", _hs256_with(b"raw"), "token_bad_algorithm", "mint"),
    ("hmac-sig-under-eddsa-header", _hs256_with_eddsa_header, "token_bad_signature", "mint"),
    ("expired", lambda e: e.sign(e.claims(exp=int(T0) - 1)), "token_expired", "mint"),
    ("expired-now", lambda e: e.sign(e.claims(exp=int(T0))), "token_expired", "mint"),
    ("not-yet-valid", lambda e: e.sign(e.claims(nbf=int(T0) + 60, iat=int(T0) - 1)),
     "token_not_yet_valid", "clock"),
    ("wrong-audience", lambda e: e.sign(e.claims(aud="someone-else")),
     "token_wrong_audience", "mint"),
    ("wrong-issuer", lambda e: e.sign(e.claims(iss="evil")), "token_wrong_issuer", "mint"),
    ("unknown-kid", _foreign_key, "token_unknown_key", "mint"),
    ("no-kid", _no_kid, "token_unknown_key", "mint"),
    ("tampered-payload", _tampered, "token_bad_signature", "mint"),
    ("bad-signature", _bad_sig, "token_bad_signature", "mint"),
    ("unknown-policy", lambda e: e.sign(e.claims(pol="deleted")), "unknown_policy", "mint"),
    ("missing-jti", _missing("jti"), "token_invalid", "mint"),
    ("missing-exp", _missing("exp"), "token_invalid", "mint"),
    ("missing-sub", _missing("sub"), "token_invalid", "mint"),
    ("missing-pol", _missing("pol"), "token_invalid", "mint"),
    ("bad-scope", lambda e: e.sign(e.claims(scope=":nope")), "token_invalid", "mint"),
    ("garbage", lambda e: "not a token", "token_malformed", "mint"),
    ("empty", lambda e: "", "token_malformed", "mint"),
    ("three-garbage-parts", lambda e: "a.b.c", "token_malformed", "mint"),
    ("header-not-json", lambda e: f"{b64(b'nope')}.{b64(e.claims())}.x", "token_malformed",
     "mint"),
    ("sk-style-api-key", lambda e: "sk-proj-0123456789abcdef", "token_malformed", "mint"),
]


@pytest.mark.parametrize(("craft", "code", "hint"), [r[1:] for r in REFUSALS],
                         ids=[r[0] for r in REFUSALS])
def test_refused(env: Env, craft: Callable[[Env], str], code: str, hint: str) -> None:
    error = refused(env.service, craft(env))
    assert error.code == code
    assert hint in error.reason.lower(), error.reason
    assert str(error).startswith(code + ": ")


# Refused after the signature verified: the refusal names the token (for the audit line).
VERIFIED_REFUSALS = {"expired", "expired-now", "not-yet-valid", "unknown-policy"}


@pytest.mark.parametrize(("name", "craft"), [r[:2] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_only_a_verified_token_names_itself_on_refusal(env: Env, name: str,
                                                      craft: Callable[[Env], str]) -> None:
    error = refused(env.service, craft(env))
    if name in VERIFIED_REFUSALS:
        assert error.identity is not None
        assert (error.identity.sandbox, error.identity.jti) == ("sb-1", "j1")
        assert error.identity.policy == ("deleted" if name == "unknown-policy" else "agent")
    else:  # forged, unsigned, foreign or malformed: its claims are never believed
        assert error.identity is None


def test_revoked(env: Env) -> None:
    minted = env.service.mint("sb-1", "agent")
    env.service.verify(minted.token)
    asyncio.run(env.state.revoke(minted.jti, time.time() + 3600))
    error = refused(env.service, minted.token)
    assert error.code == "token_revoked"
    assert minted.jti in error.reason and "mint" in error.reason
    assert error.identity is not None and error.identity.jti == minted.jti
    env.service.verify(env.service.mint("sb-1", "agent").token)  # others unaffected


def test_policy_removed_after_minting(env: Env) -> None:
    minted = env.service.mint("sb-1", "other")
    env.service.verify(minted.token)
    del env.policies["other"]
    assert refused(env.service, minted.token).code == "unknown_policy"


def test_not_yet_valid_by_the_real_clock(tmp_path: Path) -> None:
    """A token minted by a host whose clock is ahead: nbf (and iat) in the real future."""
    ahead = Env(tmp_path / "k", clock=lambda: time.time() + 3600)
    token = ahead.service.mint("sb-1", "agent").token
    verifier = TokenService(ahead.keys, ahead.state, ahead.policies.get)
    error = refused(verifier, token)
    assert error.code == "token_not_yet_valid"
    assert "clock" in error.reason


@pytest.mark.parametrize(
    ("leeway", "offset", "ok"),
    [
        (0, 899, True), (0, 900, False),
        (30, 900, True), (30, 929, True), (30, 930, False),
    ],
)
def test_leeway_on_expiry(tmp_path: Path, leeway: float, offset: float, ok: bool) -> None:
    env = Env(tmp_path / "k", leeway=leeway)
    minted = env.service.mint("sb-1", "agent", ttl=900)
    env.clock.now = T0 + offset
    if ok:
        env.service.verify(minted.token)
    else:
        assert refused(env.service, minted.token).code == "token_expired"


@pytest.mark.parametrize(("leeway", "ahead", "ok"), [(0, 1, False), (30, 29, True),
                                                     (30, 30, True), (30, 31, False)])
def test_leeway_on_not_before(tmp_path: Path, leeway: float, ahead: float, ok: bool) -> None:
    env = Env(tmp_path / "k", leeway=leeway)
    token = env.sign(env.claims(nbf=int(T0 + ahead), iat=int(T0 + ahead)))
    if ok:
        env.service.verify(token)
    else:
        assert refused(env.service, token).code == "token_not_yet_valid"


# --- minting rules ---------------------------------------------------------------------


def test_default_ttl_is_15_minutes(env: Env) -> None:
    claims = claims_of(env.service.mint("sb-1", "agent").token)
    assert claims["exp"] - claims["iat"] == 15 * 60


def test_ttl_capped_by_max_ttl(tmp_path: Path) -> None:
    env = Env(tmp_path / "k", max_ttl=3600)
    assert claims_of(env.service.mint("sb-1", "agent", ttl=3600).token)["exp"] == T0 + 3600
    with pytest.raises(TokenError, match=r"max_ttl"):
        env.service.mint("sb-1", "agent", ttl=3601)


@pytest.mark.parametrize(
    ("sandbox", "policy", "ttl", "message"),
    [
        ("sb-1", "missing", None, "policy 'missing' does not exist"),
        ("", "agent", None, "sandbox id"),
        ("a b", "agent", None, "sandbox id"),
        ("a:b", "agent", None, "sandbox id"),
        ("a@b", "agent", None, "sandbox id"),
        ("sb-1", "agent", 0, "ttl must be positive"),
        ("sb-1", "agent", -5, "ttl must be positive"),
    ],
)
def test_mint_refuses(env: Env, sandbox: str, policy: str, ttl: float | None,
                      message: str) -> None:
    with pytest.raises(TokenError, match=message):
        env.service.mint(sandbox, policy, ttl=ttl)


def test_lifetime_bounds_exp(env: Env) -> None:
    minted = env.service.mint("sb-1", "agent", ttl=900, lifetime=3600)
    assert claims_of(minted.token)["lim"] == T0 + 3600
    capped = env.service.mint("sb-1", "agent", lifetime=10**9)
    assert claims_of(capped.token)["lim"] == T0 + env.service.max_lifetime


# --- scope -----------------------------------------------------------------------------

SCOPES: list[tuple[Any, dict[str, frozenset[str] | None], str]] = [
    (None, {}, ""),
    ("", {}, ""),
    ("openai", {"openai": None}, "openai"),
    ("openai anthropic:/v1/messages",
     {"openai": None, "anthropic": frozenset({"/v1/messages"})},
     "anthropic:/v1/messages openai"),
    (["openai", "anthropic:/v1/messages anthropic:/v1/complete"],
     {"openai": None, "anthropic": frozenset({"/v1/messages", "/v1/complete"})},
     "anthropic:/v1/complete anthropic:/v1/messages openai"),
    ("  openai \t openai ", {"openai": None}, "openai"),
    ("openai:/v1/a openai", {"openai": None}, "openai"),   # the unnarrowed item wins
    ("openai openai:/v1/a", {"openai": None}, "openai"),
    ("openai:/v1/chat/** openai:/v1/a",
     {"openai": frozenset({"/v1/chat/**", "/v1/a"})}, "openai:/v1/a openai:/v1/chat/**"),
]


@pytest.mark.parametrize(("text", "parsed", "formatted"), SCOPES)
def test_parse_and_format_scope(text: Any, parsed: dict[str, Any], formatted: str) -> None:
    assert parse_scope(text) == parsed
    assert format_scope(parsed) == formatted
    assert parse_scope(formatted) == parsed


@pytest.mark.parametrize(("text", "message"), [(":/v1/x", "no credential name"),
                                               ("openai:v1/x", "must start with /")])
def test_parse_scope_errors(text: str, message: str) -> None:
    with pytest.raises(TokenError, match=message):
        parse_scope(text)


ALLOWS = [
    ("openai", "/anything", True),
    ("openai", "/v1/chat/completions?stream=true", True),
    ("anthropic", "/v1/messages", True),
    ("anthropic", "/v1/messages?beta=true", True),
    ("anthropic", "/v1/messages/batches", False),
    ("anthropic", "/v1/complete", False),
    ("anthropic", "/v1/files", True),
    ("anthropic", "/v1/files/abc", True),
    ("anthropic", "/v1/files/a/b", True),
    ("anthropic", "/v1/filesystem", False),
    ("gemini", "/", False),
]


@pytest.mark.parametrize(("name", "path", "allowed"), ALLOWS)
def test_identity_allows_credential(name: str, path: str, allowed: bool) -> None:
    identity = Identity(
        sandbox="sb", policy="agent", jti="j", issued_at=0, expires_at=1, lifetime_end=1,
        scope=parse_scope("openai anthropic:/v1/messages anthropic:/v1/files/**"),
    )
    assert identity.allows_credential(name, path) is allowed


def test_scope_survives_the_round_trip(env: Env) -> None:
    scope = parse_scope("openai:/v1/responses anthropic")
    identity = env.service.verify(env.service.mint("sb-1", "agent", scope).token)
    assert identity.scope == scope
    assert identity.allows_credential("openai", "/v1/responses")
    assert not identity.allows_credential("openai", "/v1/chat/completions")


# --- rotation and JWKS -----------------------------------------------------------------


def test_key_rotation(env: Env) -> None:
    old_kid = env.keys.signing_kid
    old = env.service.mint("sb-1", "agent")

    new_kid = env.keys.add_new()
    assert new_kid != old_kid
    assert env.keys.signing_kid == new_kid
    assert (env.directory / f"{new_kid}.pem").stat().st_mode & 0o777 == 0o600

    # The running service signs with the new key and still verifies both.
    new = env.service.mint("sb-1", "agent")
    assert header_of(new.token)["kid"] == new_kid
    env.service.verify(new.token)
    env.service.verify(old.token)

    # After a restart: same, from disk.
    restarted = env.make(SigningKeys.load(env.directory))
    assert header_of(restarted.mint("sb-1", "agent").token)["kid"] == new_kid
    restarted.verify(old.token)
    restarted.verify(new.token)

    # Retiring the old kid refuses its tokens as an unknown key; new ones keep working.
    retired = env.make(SigningKeys.load(env.directory, retired=[old_kid]))
    assert refused(retired, old.token).code == "token_unknown_key"
    retired.verify(new.token)


def test_rotation_order_is_creation_order(tmp_path: Path) -> None:
    keys = SigningKeys.load(tmp_path / "k")
    for _ in range(5):  # several keys within the same second
        kid = keys.add_new()
        assert keys.signing_kid == kid


def test_signing_keys_load(tmp_path: Path) -> None:
    with pytest.raises(TokenError, match="no usable signing key"):
        SigningKeys.load(tmp_path / "empty", create=False)
    keys = SigningKeys.load(tmp_path / "k")
    kid = keys.signing_kid
    assert SigningKeys.load(tmp_path / "k", create=False).active_kids() == [kid]
    # Every key retired: a fresh one is made rather than running without a signing key.
    again = SigningKeys.load(tmp_path / "k", retired=[kid])
    assert again.signing_kid != kid and again.active_kids() == [again.signing_kid]


def test_signing_keys_refuse_non_ed25519(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "bad.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    with pytest.raises(TokenError, match="not an Ed25519 private key"):
        SigningKeys.load(tmp_path)


def test_jwks(env: Env) -> None:
    first = env.keys.signing_kid
    second = env.keys.add_new()
    third = env.keys.add_new()
    keys = SigningKeys.load(env.directory, retired=[first])
    service = env.make(keys)
    jwks = keys.jwks()
    assert [k["kid"] for k in jwks["keys"]] == [second, third]
    for jwk in jwks["keys"]:
        assert {k: jwk[k] for k in ("kty", "crv", "alg", "use")} == {
            "kty": "OKP", "crv": "Ed25519", "alg": "EdDSA", "use": "sig"}
        assert len(b64decode(jwk["x"])) == 32
        assert "d" not in jwk  # never the private part

    token = service.mint("sb-1", "agent").token
    by_kid = {k["kid"]: k for k in jwks["keys"]}
    public = jwt.PyJWK(by_kid[header_of(token)["kid"]])
    claims = jwt.decode(token, public.key, algorithms=["EdDSA"], audience=AUDIENCE,
                        issuer="sandbox-gateway", options={"verify_exp": False,
                                                           "verify_iat": False})
    assert claims["sub"] == "sb-1"
    with pytest.raises(jwt.InvalidSignatureError):
        jwt.decode(token, jwt.PyJWK(by_kid[second]).key, algorithms=["EdDSA"],
                   audience=AUDIENCE, options={"verify_exp": False, "verify_iat": False})


# --- refresh ---------------------------------------------------------------------------


def test_refresh(env: Env) -> None:
    scope = parse_scope("openai anthropic:/v1/messages")
    first = env.service.mint("sb-1", "agent", scope, ttl=900, lifetime=2000)
    identity = env.service.verify(first.token)

    env.clock.now = T0 + 800
    second = env.service.refresh(identity)
    c = claims_of(second.token)
    assert (c["sub"], c["pol"], c["scope"], c["lim"]) == (
        "sb-1", "agent", "anthropic:/v1/messages openai", T0 + 2000)
    assert c["exp"] == T0 + 800 + 900
    assert second.jti != first.jti
    renewed = env.service.verify(second.token)

    env.clock.now = T0 + 1500  # the next refresh would pass lim: capped at lim
    third = env.service.refresh(renewed)
    assert claims_of(third.token)["exp"] == T0 + 2000
    assert claims_of(third.token)["lim"] == T0 + 2000

    env.clock.now = T0 + 2000
    with pytest.raises(TokenRefused) as info:
        env.service.refresh(renewed)
    assert info.value.code == "token_lifetime_over"
    assert "mint" in info.value.reason


def test_refresh_never_lengthens_a_token(tmp_path: Path) -> None:
    """Finding 9 of the enforcement-core issue: `?ttl=24h` on a 1-minute token gave a
    24-hour token. A refreshed token lives as long as the one presented, or less."""
    env = Env(tmp_path / "k", max_ttl=86400)
    identity = env.service.verify(env.service.mint("sb-1", "agent", ttl=60).token)
    for ask in (None, 3600.0, 86400.0):
        fresh = env.service.verify(env.service.refresh(identity, ttl=ask).token)
        assert fresh.expires_at - fresh.issued_at <= 60
    shorter = env.service.verify(env.service.refresh(identity, ttl=10).token)
    assert shorter.expires_at - shorter.issued_at <= 10


def test_cidr_binding(tmp_path: Path) -> None:
    env = Env(tmp_path / "k")
    bound = env.service.verify(env.service.mint("sb-1", "agent",
                                                 cidr=["10.0.0.5/32", "fd00::/8"]).token)
    assert bound.cidr == ("10.0.0.5/32", "fd00::/8")
    assert bound.used_from("10.0.0.5") and bound.used_from("::ffff:10.0.0.5")
    assert bound.used_from("fd00::1") and not bound.used_from("10.0.0.6")
    refreshed = env.service.verify(env.service.refresh(bound).token)
    assert refreshed.cidr == bound.cidr
    assert env.service.verify(env.service.mint("sb-1", "agent").token).used_from("1.2.3.4")
    with pytest.raises(TokenError, match="cidr"):
        env.service.mint("sb-1", "agent", cidr=["not-a-net"])


def test_a_token_names_the_person_it_acts_for(tmp_path: Path) -> None:
    """`user` at mint is the `usr` claim; refreshing keeps it; one that is not a
    person's name or address is refused at mint, and a signed claim of another shape
    (a list, a name with a space) refuses the token."""
    env = Env(tmp_path / "k")
    minted = env.service.mint("sb-1", "agent", user="alice.smith@example.com")
    assert minted.user == "alice.smith@example.com"
    named = env.service.verify(minted.token)
    assert named.user == "alice.smith@example.com"
    assert env.service.verify(env.service.refresh(named).token).user == named.user
    assert env.service.verify(env.service.mint("sb-1", "agent").token).user is None
    for bad in ("", "two words", "a|b", "x" * 129, "-lead"):
        with pytest.raises(TokenError, match="user must be"):
            env.service.mint("sb-1", "agent", user=bad)
    for claim in (["alice"], "al ice", 7):
        assert refused(env.service, env.sign(env.claims(usr=claim))).code == "token_invalid"


# --- verification cache ----------------------------------------------------------------


def test_cache_does_not_outlive_expiry(env: Env) -> None:
    minted = env.service.mint("sb-1", "agent", ttl=60)
    env.service.verify(minted.token)
    env.service.verify(minted.token)  # served from the cache
    env.clock.now = T0 + 60
    assert refused(env.service, minted.token).code == "token_expired"


def test_cache_does_not_outlive_revocation(env: Env) -> None:
    minted = env.service.mint("sb-1", "agent")
    env.service.verify(minted.token)
    asyncio.run(env.state.revoke(minted.jti, time.time() + 3600))
    assert refused(env.service, minted.token).code == "token_revoked"


def test_cache_does_not_outlive_policy(env: Env) -> None:
    minted = env.service.mint("sb-1", "other")
    env.service.verify(minted.token)
    del env.policies["other"]
    assert refused(env.service, minted.token).code == "unknown_policy"


def test_refusals_are_not_cached_as_success(env: Env) -> None:
    token = _tampered(env)
    for _ in range(2):
        assert refused(env.service, token).code == "token_bad_signature"


# --- unverified claims (for display only) ----------------------------------------------


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        ("a." + b64({"sub": "x"}) + ".b", {"sub": "x"}),
        ("garbage", {}),
        ("a.!!!.b", {}),
        ("a." + b64(b"123") + ".b", {}),
        ("a." + b64(b"[1, 2]") + ".b", {}),
        ("a." + b64(b'"text"') + ".b", {}),
        ("a." + b64(b"\xff\xfe") + ".b", {}),
    ],
)
def test_unverified_claims(token: str, expected: dict[str, Any]) -> None:
    assert unverified_claims(token) == expected


def test_use_keys_swaps_signing_and_drops_cached_verifications(env: Env) -> None:
    old = env.service.mint("sb-1", "agent")
    env.service.verify(old.token)  # cached now
    new_kid = env.keys.add_new()
    env.keys.retire(env.keys.active_kids()[0])
    env.service.use_keys(SigningKeys.load(env.directory, create=False))
    assert header_of(env.service.mint("sb-1", "agent").token)["kid"] == new_kid
    assert refused(env.service, old.token).code == "token_unknown_key"


def test_key_watcher_follows_the_directory(tmp_path: Path) -> None:
    import asyncio

    from gateway.services.identity.keywatch import SigningKeyWatcher, key_fingerprint

    directory = tmp_path / "signing"
    watcher = SigningKeyWatcher(directory)
    first = watcher.load_now().signing_kid
    seen: list[SigningKeys] = []
    watcher._on_change = seen.append

    async def check() -> bool:
        return await watcher.check()

    assert asyncio.run(check()) is False
    before = key_fingerprint(directory)
    second = SigningKeys.load(directory).add_new()
    assert key_fingerprint(directory) != before
    assert asyncio.run(check()) is True and seen[-1].signing_kid == second
    assert seen[-1].active_kids() == [first, second]
    (directory / f"{first}.pem").unlink()
    assert asyncio.run(check()) is True and seen[-1].active_kids() == [second]
    (directory / f"{second}.pem").unlink()  # no key left: refused, the last set stays
    assert asyncio.run(check()) is False and len(seen) == 2
