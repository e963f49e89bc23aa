"""Sandbox tokens: short-lived EdDSA (Ed25519) JWTs, minted, verified, rotated, revoked.

Claims: `iss`, `aud` = sandbox-gateway, `sub` (sandbox id), `pol` (policy), `scope`
(space-separated credential names, optionally narrowed `openai:/v1/chat/completions`),
`iat`, `nbf`, `exp`, `jti`, and `lim` (the sandbox's maximum lifetime: refresh never
extends a token past it); `pod` (namespace, name, uid, service account) on a token
exchanged for a Kubernetes pod's (identity.kubernetes): it is refused once that pod is
gone. Header `kid` names the signing key.

Signing keys live in a directory as `<kid>.pem` (PKCS8 Ed25519). The newest kid that is
not retired signs; every key in the directory that is not retired verifies, so adding a
key rotates and old tokens keep working until they expire or their kid is retired
(listed in `tokens.retired_kids`, or its file moved to `retired/`). A running gateway
follows the directory (`gateway/services/identity/keywatch.py`): `TokenService.use_keys`
swaps the set.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from gateway.core.identity import Identity as Identity
from gateway.core.identity import Scope as Scope
from gateway.core.identity import TokenRefused as TokenRefused
from gateway.core.identity import Workload
from gateway.net.ca import write_private
from gateway.services.identity.revocations import Revocation, Revocations
from gateway.services.state.base import StateStore

AUDIENCE = "sandbox-gateway"
USER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}")  # a token's `user` (`usr` claim)
RETIRED_DIR = "retired"  # <signing dir>/retired/<kid>.pem: kept for the record, never loaded
_VERIFY_CACHE_MAX = 50_000


class TokenError(ValueError):
    """A token request is invalid (minting side)."""


def parse_scope(text: str | Iterable[str] | None) -> dict[str, frozenset[str] | None]:
    """Parse `openai anthropic:/v1/messages` into {credential: paths or None}."""
    items = text.split() if isinstance(text, str) else [
        part for chunk in (text or ()) for part in chunk.split()
    ]
    scope: dict[str, frozenset[str] | None] = {}
    for item in items:
        name, _, path = item.partition(":")
        if not name:
            raise TokenError(f"scope item {item!r} has no credential name")
        if path and not path.startswith("/"):
            raise TokenError(f"scope item {item!r}: a path must start with /")
        if name in scope and scope[name] is None:
            continue
        if not path:
            scope[name] = None
        else:
            scope[name] = (scope.get(name) or frozenset()) | {path}
    return scope


def format_scope(scope: Scope) -> str:
    parts: list[str] = []
    for name, paths in sorted(scope.items()):
        parts.extend([name] if paths is None else [f"{name}:{p}" for p in sorted(paths)])
    return " ".join(parts)


@dataclass(frozen=True, slots=True)
class MintedToken:
    """A token just signed, and what it says (for the record of issued tokens,
    `identity/issued.py`: everything but the token itself)."""

    token: str
    jti: str
    expires_at: float
    sandbox: str = ""
    policy: str = ""
    scope: str = ""  # space-separated, as the `scope` claim
    issued_at: float = 0.0
    family: str = ""  # the first jti of its refresh chain (revoking it ends them all)
    user: str | None = None  # the person named at mint (the `usr` claim)


@dataclass
class SigningKeys:
    """The signing key directory, loaded once."""

    directory: Path
    private: dict[str, Ed25519PrivateKey] = field(default_factory=dict)
    retired: frozenset[str] = frozenset()

    @classmethod
    def load(cls, directory: Path, retired: Iterable[str] = (), create: bool = True) -> SigningKeys:
        """Load every `<kid>.pem`; create a first key if the directory has none."""
        keys = cls(directory, retired=frozenset(retired))
        paths = sorted(directory.glob("*.pem")) if directory.is_dir() else []
        for path in paths:
            try:
                key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            except (OSError, ValueError, TypeError) as exc:
                raise TokenError(f"{path}: not a readable PEM private key ({exc})") from None
            if not isinstance(key, Ed25519PrivateKey):
                raise TokenError(f"{path}: not an Ed25519 private key")
            keys.private[path.stem] = key
        if not keys.active_kids():
            if not create:
                raise TokenError(f"no usable signing key in {directory}")
            keys.add_new()
        return keys

    def active_kids(self) -> list[str]:
        return sorted(k for k in self.private if k not in self.retired)

    @property
    def signing_kid(self) -> str:
        return self.active_kids()[-1]

    def add_new(self) -> str:
        """Generate a new key; it becomes the signing key (kids sort by creation time)."""
        # Microseconds, not random hex, after the second: keys made within one second
        # must still sort in creation order, or the older one would keep signing.
        now_us = time.time_ns() // 1000
        kid = ("k" + time.strftime("%Y%m%dT%H%M%S", time.gmtime(now_us // 1_000_000))
               + f"{now_us % 1_000_000:06d}")
        key = Ed25519PrivateKey.generate()
        # Written aside, then renamed: a gateway watching the directory never reads half a key.
        tmp = self.directory / f".{kid}.pem.tmp"
        write_private(tmp, key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ))
        os.replace(tmp, self.directory / f"{kid}.pem")
        self.private[kid] = key
        return kid

    def retire(self, kid: str) -> Path:
        """Move `<kid>.pem` to `retired/`: tokens it signed stop verifying (a running
        gateway notices within seconds). The signing key cannot be retired: rotate first."""
        if kid not in self.private:
            raise TokenError(f"no key {kid!r} in {self.directory}; "
                             f"keys: {', '.join(sorted(self.private)) or 'none'}")
        if kid == self.signing_kid:
            raise TokenError(f"{kid} is the signing key; run `token rotate-key` first, then "
                             "retire it")
        target = self.directory / RETIRED_DIR / f"{kid}.pem"
        target.parent.mkdir(mode=0o700, exist_ok=True)
        os.replace(self.directory / f"{kid}.pem", target)
        del self.private[kid]
        return target

    def public_keys(self) -> dict[str, Ed25519PublicKey]:
        return {kid: self.private[kid].public_key() for kid in self.active_kids()}

    def jwks(self) -> dict[str, Any]:
        """The public keys as a JWK Set (RFC 8037 OKP keys)."""
        out = []
        for kid, pub in self.public_keys().items():
            raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            x = base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
            out.append({"kty": "OKP", "crv": "Ed25519", "x": x, "kid": kid,
                        "alg": "EdDSA", "use": "sig"})
        return {"keys": out}


class TokenService:
    """Mint and verify tokens; verification results are cached per token string."""

    def __init__(
        self,
        keys: SigningKeys,
        state: StateStore,
        policy_credentials: Callable[[str], Iterable[str] | None],
        *,
        issuer: str = "sandbox-gateway",
        default_ttl: float = 900.0,
        max_ttl: float = 86400.0,
        max_lifetime: float = 7 * 86400.0,
        leeway: float = 0.0,
        clock: Any = time.time,
        policy_ttl: Callable[[str], float | None] = lambda name: None,
    ) -> None:
        self.keys = keys
        self.state = state
        self.policy_credentials = policy_credentials
        self.policy_ttl = policy_ttl  # a policy's `tokens: {ttl}`, the default before ours
        self.issuer = issuer
        self.default_ttl = default_ttl
        self.max_ttl = max_ttl
        self.max_lifetime = max_lifetime
        self.leeway = leeway
        self.clock = clock
        self._public = keys.public_keys()
        self._cache: dict[str, Identity] = {}
        self.revocations = Revocations(state)  # held here first, then in the store

    def use_keys(self, keys: SigningKeys) -> None:
        """Sign with `keys`' newest key from now on and verify with all of its keys; a
        token whose key is gone (deleted, moved to retired/) is refused from now on."""
        self.keys = keys
        self._public = keys.public_keys()
        self._cache = {}

    def mint(
        self,
        sandbox: str,
        policy: str,
        scope: Scope | None = None,
        ttl: float | None = None,
        lifetime: float | None = None,
        lifetime_end: float | None = None,
        family: str | None = None,
        cidr: Iterable[str] = (),
        workload: Workload | None = None,
        user: str | None = None,
    ) -> MintedToken:
        """Sign a token. `scope` None = every credential the policy references.
        `family`: the first jti of a refresh chain (a fresh mint starts a new one).
        `cidr`: bind the token to these source networks (a leaked token is then useless
        from anywhere else). `workload`: the pod the token is bound to (its sandbox id
        is then `<namespace>/<pod>`). `user`: the person the operator names (the `usr`
        claim; an MCP OAuth rule with `consent: user` keeps one grant per user)."""
        if workload is not None:
            if sandbox != f"{workload.namespace}/{workload.pod}":
                raise TokenError("a pod's token names the pod as its sandbox")
        elif not sandbox or not sandbox.replace("-", "").replace("_", "").replace(
                ".", "").isalnum():
            raise TokenError("sandbox id must be letters, digits, '-', '_' or '.'")
        check_user(user)
        credentials = self.policy_credentials(policy)
        if credentials is None:
            raise TokenError(f"policy {policy!r} does not exist; see GET /v1/policies")
        if scope is None:
            scope = {name: None for name in credentials}
        chosen = ttl
        if ttl is None:
            ttl = self.policy_ttl(policy) or self.default_ttl
        if ttl <= 0:
            raise TokenError("ttl must be positive")
        if ttl > self.max_ttl:
            if chosen is not None:
                raise TokenError(f"ttl {ttl:.0f}s is longer than tokens.max_ttl "
                                 f"({self.max_ttl:.0f}s)")
            raise TokenError(f"policy {policy!r} sets tokens: {{ttl: {ttl:.0f}s}}, which is "
                             f"longer than tokens.max_ttl ({self.max_ttl:.0f}s); shorten it "
                             "or raise the gateway's tokens.max_ttl")
        now = self.clock()
        if lifetime_end is None:
            lifetime = self.max_lifetime if lifetime is None else min(lifetime, self.max_lifetime)
            lifetime_end = now + max(lifetime, ttl)
        exp = min(now + ttl, lifetime_end)
        jti = uuid.uuid4().hex
        claims: dict[str, Any] = {
            "iss": self.issuer, "aud": AUDIENCE, "sub": sandbox, "pol": policy,
            "scope": format_scope(scope), "iat": int(now), "nbf": int(now),
            "exp": int(exp), "jti": jti, "lim": int(lifetime_end), "fam": family or jti,
        }
        networks = parse_cidrs(cidr)
        if networks:
            claims["cidr"] = " ".join(networks)
        if workload is not None:
            claims["pod"] = workload.fields()
        if user is not None:
            claims["usr"] = user
        kid = self.keys.signing_kid
        token = jwt.encode(claims, self.keys.private[kid], algorithm="EdDSA",
                           headers={"kid": kid})
        return MintedToken(token=token, jti=jti, expires_at=float(int(exp)), sandbox=sandbox,
                           policy=policy, scope=claims["scope"], issued_at=float(int(now)),
                           family=claims["fam"], user=user)

    def verify(self, token: str) -> Identity:
        """Return the token's identity or raise TokenRefused (never returns a bad token)."""
        identity = self._cache.get(token)
        if identity is None:
            identity = self._verify_signature(token)
            if len(self._cache) >= _VERIFY_CACHE_MAX:
                self._cache.clear()
            self._cache[token] = identity
        # From here on the signature has verified: a refusal carries the identity (audit).
        now = self.clock()
        if now >= identity.expires_at + self.leeway:
            raise TokenRefused("token_expired", f"the token expired at {_iso(identity.expires_at)}"
                               "; mint a new one (sandbox-gateway token mint) or refresh it",
                               identity)
        if now + self.leeway < identity.issued_at:
            raise TokenRefused("token_not_yet_valid",
                               "the token is not valid yet (nbf in the future); check clocks",
                               identity)
        if self.revoked(identity):
            raise TokenRefused("token_revoked", f"token {identity.jti} was revoked; mint a new one",
                               identity)
        if self.policy_credentials(identity.policy) is None:
            raise TokenRefused("unknown_policy", f"the token names policy {identity.policy!r}, "
                               "which is not loaded; mint a token for an existing policy",
                               identity)
        return identity

    async def revoke(self, jti: str) -> Revocation:
        """Revoke the token `jti` (and every token refreshed from it), kept until no token
        of it can still be valid: in this process at once, on every worker through the
        supervisor's relay, in the state store when it can be written
        (`identity/revocations.py`; the outcome says where it holds)."""
        return await self.revocations.revoke(jti, time.time() + self.max_lifetime)

    def revoked(self, identity: Identity) -> bool:
        """Was this token, or the family it was refreshed from, revoked? (No I/O: this
        process's revocations and the state store's view.)"""
        return (self.revocations.is_revoked(identity.jti)
                or self.revocations.is_revoked(identity.family))

    def _verify_signature(self, token: str) -> Identity:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise TokenRefused("token_malformed", "the credential is not a gateway token (JWT); "
                               "use a token from sandbox-gateway token mint") from None
        if header.get("alg") != "EdDSA":
            raise TokenRefused("token_bad_algorithm",
                               f"token algorithm {str(header.get('alg'))[:16]!r} is not accepted; "
                               "gateway tokens are EdDSA: mint one with sandbox-gateway token mint")
        kid = header.get("kid")
        key = self._public.get(kid) if isinstance(kid, str) else None
        if key is None and kid in self.keys.active_kids():
            self._public = self.keys.public_keys()  # a key added since (add_new) signs now
            key = self._public.get(kid)
        if key is None:
            raise TokenRefused("token_unknown_key", "the token's signing key (kid) is unknown or "
                               "retired; mint a new token")
        try:
            claims = jwt.decode(
                token, key=key, algorithms=["EdDSA"], audience=AUDIENCE, issuer=self.issuer,
                leeway=self.leeway,
                # Time claims are checked in verify() against self.clock, every time.
                options={"require": ["iss", "aud", "sub", "exp", "nbf", "iat", "jti"],
                         "verify_exp": False, "verify_nbf": False, "verify_iat": False},
            )
        except jwt.InvalidAudienceError:
            raise TokenRefused("token_wrong_audience",
                               "the token is not for sandbox-gateway (aud); mint one with "
                               "sandbox-gateway token mint") from None
        except jwt.InvalidIssuerError:
            raise TokenRefused("token_wrong_issuer", "the token was issued by another "
                               "issuer (iss); mint one from this gateway") from None
        except jwt.InvalidSignatureError:
            raise TokenRefused("token_bad_signature", "the token signature does not verify; "
                               "mint a new token") from None
        except jwt.PyJWTError as exc:
            raise TokenRefused("token_invalid", f"the token is invalid ({type(exc).__name__}); "
                               "mint a new token") from None
        try:
            scope = parse_scope(str(claims.get("scope", "")))
            return Identity(
                sandbox=str(claims["sub"]), policy=str(claims["pol"]), jti=str(claims["jti"]),
                scope=scope, issued_at=float(claims["nbf"]), expires_at=float(claims["exp"]),
                lifetime_end=float(claims.get("lim", claims["exp"])),
                family=str(claims.get("fam", claims["jti"])),
                cidr=tuple(parse_cidrs(str(claims.get("cidr", "")).split())),
                workload=_workload(claims.get("pod")),
                user=_user(claims.get("usr")),
            )
        except (KeyError, TypeError, ValueError, TokenError):
            raise TokenRefused("token_invalid", "the token's claims are incomplete; "
                               "mint a new token") from None

    def refresh(self, identity: Identity, ttl: float | None = None) -> MintedToken:
        """Exchange a verified token for a fresh one with the same lifetime as the one
        presented (`ttl` can only shorten it), never past the chain's lifetime end."""
        now = self.clock()
        if now >= identity.lifetime_end:
            raise TokenRefused("token_lifetime_over", "the sandbox's maximum lifetime is over; "
                               "mint a new token")
        own = max(1.0, identity.expires_at - identity.issued_at)
        return self.mint(identity.sandbox, identity.policy, identity.scope,
                         ttl=own if ttl is None else min(ttl, own),
                         lifetime_end=identity.lifetime_end, family=identity.family,
                         cidr=identity.cidr, workload=identity.workload, user=identity.user)


def parse_cidrs(items: Iterable[str]) -> list[str]:
    """Canonical network texts for a token's `cidr` binding (TokenError if invalid)."""
    out: list[str] = []
    for item in items:
        for text in item.replace(",", " ").split():
            try:
                out.append(ipaddress.ip_network(text, strict=False).compressed)
            except ValueError:
                raise TokenError(
                    f"cidr {text!r} is not an IP network (e.g. 10.0.0.5/32)") from None
    return out


def check_user(user: str | None) -> str | None:
    """A token's `user` as given at mint (TokenError if it is not a person's name or
    address: letters, digits and ``. _ @ + -``, at most 128 characters)."""
    if user is None:
        return None
    if not USER.fullmatch(user):
        raise TokenError("user must be a person's name or address: letters, digits and "
                         "'.', '_', '@', '+', '-' (at most 128 characters)")
    return user


def _user(claim: Any) -> str | None:
    """The `usr` claim (TypeError if present and not a name: the token is refused)."""
    if claim is None:
        return None
    if not isinstance(claim, str) or not USER.fullmatch(claim):
        raise TypeError("usr")
    return claim


def _workload(claim: Any) -> Workload | None:
    """The `pod` claim (KeyError/TypeError if present and incomplete)."""
    if claim is None:
        return None
    return Workload(str(claim["namespace"]), str(claim["pod"]), str(claim["uid"]),
                    str(claim["service_account"]))


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def unverified_claims(token: str) -> dict[str, Any]:
    """Decode claims without verifying (for `explain` output only, never for decisions)."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError):
        return {}
    return dict(claims) if isinstance(claims, dict) else {}
