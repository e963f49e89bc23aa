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

import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import jwt

from gateway.core.identity import Identity as Identity
from gateway.core.identity import Scope as Scope
from gateway.core.identity import TokenRefused as TokenRefused
from gateway.core.identity import Workload
from gateway.services.identity.claims import (
    TokenError,
    check_user,
    format_scope,
    parse_cidrs,
    parse_scope,
    read_user,
    read_workload,
)
from gateway.services.identity.revocations import Revocation, Revocations
from gateway.services.identity.signing_keys import SigningKeys
from gateway.services.state.base import StateStore

AUDIENCE = "sandbox-gateway"
_VERIFY_CACHE_MAX = 50_000


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
                workload=read_workload(claims.get("pod")),
                user=read_user(claims.get("usr")),
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


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))

